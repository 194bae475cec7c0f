"""What a replica serves, as its ``model_info`` control op answers: the contract between
the driver that describes its model and the router that checks requests against it.

The driver builds a :class:`ModelInfo` (its boot facts, :class:`ReplicaFacts`, and what
its pipeline holds now) and sends it as a msgpack map, so the wire form keeps these
field names; ``GET /model_info``, ``/v1/models`` and ``/server_info`` show the same
names. The router decodes each replica's answer once (:func:`decode`): a field missing,
renamed or of the wrong type is a replica that does not serve, with the field named,
never a default standing in for it. Fields a newer peer adds are ignored, as the
message header's are.

The bounds a request is checked against come from here once (:meth:`ReplicaFacts.limits`):
the replica's driver and the router's routes check with the same :class:`Limits`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec

from dpserve.contract.validation import (
    Limits,
)

Positive = Annotated[int, msgspec.Meta(ge=1)]


class ModelInfoError(ValueError):
    """A ``model_info`` answer that does not match this contract."""


class GangShape(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's parallel degrees (dpserve.contract.layout); a deployment's dp is its
    replicas."""

    tp: Positive
    sp: Positive
    ulysses: Positive
    ring: Positive
    cfg: Positive


class CompileInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``--compile``: the sizes compiled (``WxH``), the graphs warm-up made, other sizes."""

    sizes: list[str]
    warmup_graphs: int
    other_shapes: str


class TextLength(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The text tokens a request may ask (``max_sequence_length``): at most ``max``,
    and ``prefix + max_sequence_length`` a multiple of ``multiple_of``. ``prefix``: the
    tokens the model puts ahead of the request's (SD3's padded CLIP prompt), which a
    sequence split cuts with them; shown only where there are some."""

    max: Positive
    multiple_of: Positive
    prefix: Annotated[int, msgspec.Meta(ge=0)] = 0


class FlowShift(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler has a shift a request may set; ``default`` None: by image size."""

    default: float | None


class VideoFeatures(msgspec.Struct, frozen=True, kw_only=True):
    """A video model's frames (dpserve.contract.video): counts are ``frame_factor * k + 1``."""

    max_frames: Positive
    frame_factor: Positive
    default_frames: Positive
    default_fps: Positive
    image_to_video: bool  # takes an input_reference image
    text_to_video: bool  # False: it needs one


class Features(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the model serves beyond plain generation, as clients see it (``/v1/models``).

    Every field is required but ``step_caches_unavailable``, which is left out while
    step caches are offered (hence ``omit_defaults``: no other field has a default).
    """

    edits: bool
    inpainting: bool
    max_edit_images: int
    partial_images: int  # previews per image; 0: it cannot preview
    output_formats: list[str]
    output_compression: bool
    max_n: Positive
    step_caches: dict[str, dict[str, int | float]]  # kind -> its knob's default
    step_cache_default: dict[str, str | int | float] | None  # as a request writes it
    step_caches_unavailable: str | None = None  # why none is offered
    max_sequence_length: TextLength | None  # None: the pipeline takes none
    flow_shift: FlowShift | None  # None: its scheduler has no shift
    vae_tiling: bool
    vae_slicing: bool
    video: VideoFeatures | None  # None: an image model


class RankWeights(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's weight bytes per module, where it sits in the gang."""

    rank: int
    tp_rank: int
    sp_rank: int
    cfg_rank: int
    bytes: dict[str, int]


class ReplicaFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What a replica knows about itself once it has booted."""

    replica: int
    layout: str  # dpserve.contract.layout.describe of its gang
    parallel: GangShape
    gang_size: Positive
    threads_per_rank: Positive
    device: str
    dtype: str
    size_factor: Positive  # widths and heights are multiples of it
    max_side: Positive
    max_steps: Positive
    max_sequence_length: int | None  # the service's text tokens (None: none taken)
    max_sessions: int
    session_idle_timeout_s: float
    compile: CompileInfo | None  # None: not compiled
    realtime: str  # "supported", else why not
    features: Features
    cfg_parallel: str
    without_true_cfg: str

    def limits(self) -> Limits:
        """The bounds every request to this model is checked against, by the replica
        before it queues one and by the router before it sends one."""
        limits = Limits(
            max_n=self.features.max_n,
            min_side=self.size_factor,
            max_side=self.max_side,
            size_factor=self.size_factor,
            max_steps=self.max_steps,
            sequence_split=self.parallel.sp,
        )
        video = self.features.video
        if video is None:
            return limits  # max_frames 0: it makes no videos
        return dataclasses.replace(
            limits,
            max_frames=video.max_frames,
            frame_factor=video.frame_factor,
            default_frames=video.default_frames,
            default_fps=video.default_fps,
        )


class ModelInfo(ReplicaFacts, frozen=True, kw_only=True):
    """A replica's answer to ``model_info``: its facts and what its pipeline holds now."""

    model_path: str  # the transformer's folder (update_weights_from_disk changes it)
    pipeline_class: str
    components: list[str]
    released: bool  # weights released from the device
    loras: list[str]
    rank_weights: list[RankWeights]  # one per rank of the gang
    ranks: Positive


def decode(raw: Mapping[str, Any]) -> ModelInfo:
    """A replica's ``model_info`` result; :class:`ModelInfoError` names what is wrong."""
    try:
        return msgspec.convert(raw, ModelInfo)
    except msgspec.ValidationError as exc:
        raise ModelInfoError(f"model_info does not match this version's contract: {exc}") from None


def gathered(per_rank: Sequence[ModelInfo]) -> ModelInfo:
    """The replica's answer from each rank's (the first rank's, with every rank's weights)."""
    weights = [w for info in per_rank for w in info.rank_weights]
    return msgspec.structs.replace(per_rank[0], rank_weights=weights, ranks=len(per_rank))
