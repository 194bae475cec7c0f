"""Fields that SGLang's and vLLM-Omni's image clients send, as this server takes them
(docs/router.md, "Fields from other servers").

Each is mapped to the field of this server that does the same, accepted where it
cannot change the output here, or refused with a 400 naming what to send instead.
None that would change the image is dropped. ``max_sequence_length``, ``flow_shift``,
``vae_use_tiling`` and ``vae_use_slicing`` are this server's own fields under the
peers' names (dpserve.contract.protocol), so they need nothing here; so is vLLM-Omni's
``lora`` (docs/lora.md). SGLang has no per-request adapters (its ``set_lora`` is
service-wide, as this server's is).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv

# SGLang's output_quality names and the JPEG/WebP quality each stands for there.
OUTPUT_QUALITIES: Final[Mapping[str, int]] = {
    "maximum": 100,
    "high": 90,
    "default": 75,
    "medium": 55,
    "low": 35,
}
# SGLang's cache switches, and the step cache here that skips the same way: both
# TeaCache and cache-dit's DBCache skip the denoiser's remaining work while its
# input changes little from step to step, as first_block_cache does.
CACHE_SWITCHES: Final[Mapping[str, str]] = {
    "enable_teacache": "first_block_cache",
    "enable_cache_dit": "first_block_cache",
}
GENERATOR_DEVICE: Final = "cpu"  # where this server draws every seed's noise
# Keyword bags a peer passes into its pipeline call. This server passes none: each
# setting it honours is a typed field, checked against what the model takes.
_KEYWORD_BAGS: Final = ("diffusers_kwargs", "extra_params")
_NAMED_FIELDS: Final = (
    "negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, "
    "max_sequence_length, flow_shift, vae_use_tiling, vae_use_slicing, step_cache"
)
# What translate reads (the fields the image routes take are dpserve/router/fields.py's).
_PEER_FIELDS: Final = frozenset(
    {*CACHE_SWITCHES, "output_quality", "generator_device", *_KEYWORD_BAGS}
)


def translate(body: Any) -> tuple[Any, list[p.FieldError]]:
    """``body`` with the peers' fields turned into this server's, and what is wrong
    with them. A peer field sent as null is left out, as any null field is."""
    if not isinstance(body, Mapping):
        return body, []
    out = {k: v for k, v in body.items() if not (k in _PEER_FIELDS and v is None)}
    bad: list[p.FieldError] = []
    _step_cache(out, bad)
    _output_quality(out, bad)
    device = out.pop("generator_device", None)
    if device is not None and device != GENERATOR_DEVICE:
        bad.append(
            p.FieldError(
                "generator_device",
                f"must be {GENERATOR_DEVICE!r} or left out, got {_shown(device)}: this server "
                "draws every seed's noise on the CPU, so a seed gives the same starting "
                "noise on any device",
            )
        )
    for name in _KEYWORD_BAGS:
        bag = out.pop(name, None)
        if bag is not None and bag != {}:
            bad.append(p.FieldError(name, _bag_message(bag)))
    return out, bad


def _step_cache(out: dict[str, Any], bad: list[p.FieldError]) -> None:
    """enable_teacache / enable_cache_dit: true asks for the matching step cache,
    false for none (whatever the service's default)."""
    switches = {name: out.pop(name) for name in CACHE_SWITCHES if name in out}
    if not switches:
        return
    wrong = [name for name, value in switches.items() if not isinstance(value, bool)]
    for name in wrong:
        bad.append(p.FieldError(name, f"must be true or false, got {_shown(switches[name])}"))
    if wrong:
        return
    if out.get("step_cache") is not None:
        first = next(iter(switches))
        bad.append(p.FieldError(first, "give step_cache or this, not both"))
        return
    chosen = [CACHE_SWITCHES[name] for name, on in switches.items() if on]
    out["step_cache"] = chosen[0] if chosen else pv.STEP_CACHE_OFF


def _output_quality(out: dict[str, Any], bad: list[p.FieldError]) -> None:
    """SGLang's quality names as output_compression; a PNG has no quality to set."""
    quality = out.pop("output_quality", None)
    if quality is None:
        return
    if not isinstance(quality, str) or quality not in OUTPUT_QUALITIES:
        names = ", ".join(OUTPUT_QUALITIES)
        bad.append(p.FieldError("output_quality", f"must be one of {names}, got {_shown(quality)}"))
    elif out.get("output_compression") is not None:
        bad.append(p.FieldError("output_quality", "give output_compression or this, not both"))
    elif out.get("output_format", "png") in pv.COMPRESSIBLE_FORMATS:
        out["output_compression"] = OUTPUT_QUALITIES[quality]


def _bag_message(bag: Any) -> str:
    keys = sorted(str(k) for k in bag) if isinstance(bag, Mapping) else []
    ours = [k for k in keys if k in pv.GENERATE_FIELDS]
    hint = f"send {', '.join(ours)} as top-level fields" if ours else f"send {_NAMED_FIELDS}"
    return (
        "passes keywords into the pipeline call, which this server does not do (each "
        f"setting it honours is a typed field, checked against the model): {hint}; "
        "GET /v1/models lists the fields"
    )


def _shown(value: Any) -> str:
    """A value for a message: short, and never a Python repr of an object."""
    if isinstance(value, bool | int | float | str) or value is None:
        return repr(value)[:40]
    return type(value).__name__
