"""The options of the processes, each spelled once: ``WorkerConfig`` (``worker``) and
``RouterConfig`` (``router``), with ``flags`` deriving argparse, passed-on flags and
mirrored defaults from them.

The CLI, ``serve``, the router, the worker and the operator all import this package,
so it is stdlib only and imports none of them.
"""
