"""One transformers warning that tells a dpserve user nothing, dropped by its words.

transformers 5 warns once per process and class that ``CLIPImageProcessor`` (and
``SiglipImageProcessor``, ``Siglip2ImageProcessor``) "requires torchvision (not
installed); falling back to" its PIL twin, when diffusers' pipeline modules name
those classes: Flux's optional IP-Adapter ``feature_extractor``, Wan
image-to-video's image-encoder input, and every pipeline module that the edit
siblings' lookup imports. The PIL twin is the processor every transformers before 5
used, so without torchvision nothing changes; installing torchvision (hundreds of
MB) would only change which backend resizes an IP-Adapter or image-encoder input.
Only that message goes: every other transformers warning still shows.
"""

from __future__ import annotations

import logging

# transformers.utils.import_utils logs it (its _LazyModule.__getattr__, warning_once).
LOGGER = "transformers.utils.import_utils"
WORDS = "requires torchvision (not installed); falling back to"


class _DropTorchvisionFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return WORDS not in record.getMessage()


def quiet_torchvision_fallback() -> None:
    """Install the filter (idempotent); call before diffusers' pipelines are imported."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, _DropTorchvisionFallback) for f in logger.filters):
        logger.addFilter(_DropTorchvisionFallback())
