"""Model sources: a diffusers pipeline from ``hf://`` or ``s3://`` into a local cache,
once per cache, verified against the source's own digests and published atomically.

Pure parts (``uri``, ``select``, ``plan``, ``progress``) import nothing but the
standard library, so the operator can use them; ``s3`` needs boto3 and ``hub``
huggingface_hub, each imported only when that source is fetched. Nothing here imports
torch, diffusers or FastAPI (tests/unit/test_imports.py). docs/models.md says why.
"""
