"""Step caches: diffusers' cache hooks on the denoiser, attached for one pipeline call.

Two kinds are offered, both verified on Flux transformers (docs/worker.md, "Step
caching"; bench/step_cache.py measures them):

- ``first_block_cache`` (``FirstBlockCacheConfig``): the first block always runs;
  when its residual changed by less than ``threshold`` (relative mean absolute
  difference) since the last full step, the other blocks are skipped and their
  last residual is reused.
- ``taylorseer`` (``TaylorSeerCacheConfig``, lite mode): after three full steps,
  the blocks run only every ``interval`` steps; in between the output projection's
  input is predicted by a first-order Taylor expansion over the steps.

Hooks are attached before the call and removed after it, so every call starts
with fresh state and nothing carries over to the next request (where they sit
among the denoiser's other layers: ``denoiser_stack.py``). The hooks keep
their state per ``cache_context`` ("cond", "uncond"). Under CFG-parallel each
rank runs every call of its own branch inside that branch's context (the denoiser
patch enters the original context), so each rank decides exactly as one process
does for that branch and the images equal one rank's. A cached request without
true CFG is not lent to a sequence split over the CFG ranks: both run it whole
and decide alike.

Tensor and sequence parallel are refused: first-block-cache decides from the
activations a rank holds (a sequence slice under sp), so ranks could take
different branches and desynchronise their collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from dpserve.contract.protocol import (
    UNSUPPORTED,
    FieldError,
    RequestError,
    StepCache,
)
from dpserve.contract.validation import (
    STEP_CACHE_KNOBS,
    STEP_CACHE_OFF,
    FieldChecker,
    parse_step_cache,
)

# Each kind's knob default: Flux's usual first-block-cache threshold; an interval
# that computes one step in three once TaylorSeer has its first three steps.
DEFAULTS: Final[Mapping[str, float]] = {"first_block_cache": 0.08, "taylorseer": 3}
# Denoisers the caches were verified on (tests/integration/test_step_cache.py).
VERIFIED: Final = frozenset({"FluxTransformer2DModel"})
_FULL_STEPS: Final = 3  # TaylorSeer's steps before it predicts anything


def service_default(
    kind: str | None, threshold: float | None, interval: int | None
) -> StepCache | None:
    """The service's default from its flags (``--step-cache`` and its knob); a knob
    that is not the kind's, or out of bounds, is a ``ValueError`` naming the flag."""
    body: dict[str, Any] = {"type": kind} if kind is not None else {}
    for knob, value in (("threshold", threshold), ("interval", interval)):
        if value is not None:
            if kind is None:
                raise ValueError(f"--step-cache-{knob} needs --step-cache")
            body[knob] = value
    if kind is None:
        return None
    check = FieldChecker({})
    cache = parse_step_cache(check, body)
    if check.errors:
        raise ValueError("--step-cache: " + "; ".join(e.message for e in check.errors))
    return cache


@dataclass(frozen=True)
class StepCaches:
    """What this replica offers: the kinds it applies, its default (None: uncached
    unless a request asks), and, when it offers none, why."""

    offered: tuple[str, ...]
    default: StepCache | None = None
    refusal: str | None = None

    def offered_knobs(self) -> dict[str, dict[str, int | float]]:
        """Each kind offered with its knob's default (model_info's ``step_caches``)."""
        return {kind: {knob_of(kind): DEFAULTS[kind]} for kind in self.offered}

    def default_knobs(self) -> dict[str, str | int | float] | None:
        """The service's default as a request writes it (``step_cache_default``)."""
        return None if self.default is None else knobs(self.default)

    def check(self, requested: StepCache | None) -> None:
        """Refuse, naming the field and what is offered, a kind this replica lacks."""
        if requested is None or requested.type == STEP_CACHE_OFF:
            return
        if requested.type in self.offered:
            return
        why = f" ({self.refusal})" if self.refusal else ""
        allowed = (
            f"must be one of: {', '.join(self.offered)}, or none"
            if self.offered
            else "must be none or left out"
        )
        raise RequestError(
            UNSUPPORTED,
            f"this replica does not offer the step cache {requested.type}{why}",
            [FieldError("step_cache", allowed)],
        )

    def resolve(self, requested: StepCache | None) -> StepCache | None:
        """The cache a call runs with: the request's, else the service's; its knob filled."""
        chosen = self.default if requested is None else requested
        if chosen is None or chosen.type == STEP_CACHE_OFF:
            return None
        return filled(chosen)


def knob_of(kind: str) -> str:
    return STEP_CACHE_KNOBS[kind][0]


def filled(cache: StepCache) -> StepCache:
    """``cache`` with its knob's default where the request left it out."""
    knob = knob_of(cache.type)
    if getattr(cache, knob) is not None:
        return cache
    value = DEFAULTS[cache.type]
    if knob == "interval":
        return StepCache(type=cache.type, interval=int(value))
    return StepCache(type=cache.type, threshold=value)


def knobs(cache: StepCache) -> dict[str, Any]:
    """The JSON shape of a (filled) cache, as a request writes it."""
    full = filled(cache)
    knob = knob_of(full.type)
    return {"type": full.type, knob: getattr(full, knob)}


def offer(denoiser: torch.nn.Module, refusal: str | None) -> StepCaches:
    """The kinds this denoiser gets, unless the replica's set-up refuses them all."""
    if refusal is None and type(denoiser).__name__ not in VERIFIED:
        verified = ", ".join(sorted(VERIFIED))
        refusal = f"step caches are verified on {verified}, not {type(denoiser).__name__}"
    if refusal is not None or not hasattr(denoiser, "enable_cache"):
        return StepCaches((), refusal=refusal or "the denoiser takes no cache hooks")
    return StepCaches(tuple(STEP_CACHE_KNOBS))


def config_of(cache: StepCache) -> Any:
    """The diffusers hook configuration for a filled cache."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    if cache.type == "first_block_cache":
        assert cache.threshold is not None
        return FirstBlockCacheConfig(threshold=cache.threshold)
    assert cache.type == "taylorseer" and cache.interval is not None
    return TaylorSeerCacheConfig(
        cache_interval=cache.interval,
        disable_cache_before_step=_FULL_STEPS,
        # Its default, bfloat16, rounds the prediction; lite mode keeps only the
        # output projection's input, so float32 costs little.
        taylor_factors_dtype=torch.float32,
        use_lite_mode=True,
    )


@contextlib.contextmanager
def applied(denoiser: torch.nn.Module, cache: StepCache | None) -> Iterator[None]:
    """The cache's hooks on ``denoiser`` for one call (none when ``cache`` is None)."""
    if cache is None:
        yield
        return
    module: Any = denoiser
    module.enable_cache(config_of(cache))
    try:
        # The hooks keep their state per cache_context. Flux's text-to-image pipeline
        # enters one at each denoiser call; its image-to-image and inpainting pipelines
        # enter none, so their calls run in "cond" (a pipeline's own contexts override it).
        with module.cache_context("cond"):
            yield
    finally:
        module.disable_cache()


def refusal(tp: int, sp: int, compiled: bool) -> str | None:
    """Why a replica with this set-up offers no step cache, or None."""
    if tp > 1 or sp > 1:
        return (
            f"not under tensor or sequence parallel (tp={tp}, sp={sp}): a rank deciding "
            "from its own slice could skip where another computes"
        )
    if compiled:
        return "not with --compile: the hooks change the blocks the warmed graphs traced"
    return None
