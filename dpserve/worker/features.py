"""What the loaded model serves beyond plain generation, as ``model_info`` reports it
and the ingress checks requests against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpserve.protocol import MAX_PARTIAL_IMAGES, OUTPUT_FORMATS, Limits
from dpserve.worker.edit import EditSupport, edit_support
from dpserve.worker.pipeline import Pipeline
from dpserve.worker.preview import can_preview
from dpserve.worker.step_cache import StepCaches


@dataclass(frozen=True)
class Features:
    edit: EditSupport
    partial_images: int  # previews per image it can send; 0: it cannot preview
    max_n: int = Limits.max_n
    step_caches: StepCaches = field(default_factory=lambda: StepCaches(()))

    def info(self) -> dict[str, Any]:
        """The ``features`` entry of model_info (the router shows it to clients)."""
        return {
            "edits": self.edit.edits,
            "inpainting": self.edit.inpainting,
            "max_edit_images": self.edit.max_images,
            "partial_images": self.partial_images,
            "output_formats": list(OUTPUT_FORMATS),
            "output_compression": True,
            "max_n": self.max_n,
            **self.step_caches.info(),
        }


def features_of(
    pipe: Pipeline, max_n: int = Limits.max_n, step_caches: StepCaches | None = None
) -> Features:
    return Features(
        edit=edit_support(pipe),
        partial_images=MAX_PARTIAL_IMAGES if can_preview(pipe) else 0,
        max_n=max_n,
        step_caches=step_caches or StepCaches(()),
    )
