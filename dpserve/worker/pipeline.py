"""Loading a diffusers pipeline folder and turning a request into pipeline arguments."""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeAlias

import diffusers
import torch
from diffusers import DiffusionPipeline
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from dpserve.contract.control_state import DENOISERS
from dpserve.contract.cost import cfg_branches
from dpserve.contract.protocol import (
    INVALID_REQUEST,
    UNSUPPORTED,
    CostReport,
    FieldError,
    GenerateParams,
    RequestError,
)
from dpserve.worker.paths import pickle_problem
from dpserve.worker.weights import modules_of, own_storage

log = logging.getLogger(__name__)

# diffusers pipelines gain their components and loader mixins at run time, which
# static typing cannot follow; the worker treats them as dynamic objects.
Pipeline: TypeAlias = Any
# (component folder, its class, dtype) -> the component, prepared; None: load it whole.
ReadTransformer: TypeAlias = Callable[[Path, Any, torch.dtype], torch.nn.Module | None]
# The components a gang splits (DENOISERS): the denoiser, and Wan 2.2's second one (its
# low-noise expert, which the pipeline calls below its boundary timestep).

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Request fields and the pipeline argument each one needs; a field the
# pipeline does not take is refused by name instead of silently ignored.
_FIELD_ARGS: Mapping[str, str] = {
    "negative_prompt": "negative_prompt",
    "width": "width",
    "height": "height",
    "num_inference_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "true_cfg_scale": "true_cfg_scale",
    "max_sequence_length": "max_sequence_length",
}


def resolve_device(name: str, rank: int, first_gpu: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", first_gpu + rank)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_pipeline(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    prepare: Callable[[torch.nn.Module], object] = lambda module: module,
    skip: Mapping[str, None] | None = None,
    read: ReadTransformer = lambda folder, cls, dtype: None,
) -> Pipeline:
    """Any diffusers pipeline folder, offline; nothing here knows which model it is.

    ``read`` may build the transformer itself (a tp rank reads only its pieces:
    ``ModelParallel.read_transformer``), already prepared; when it returns None the
    transformer loads whole and ``prepare`` gets it before it moves to the device
    (so a rank that keeps a shard of it never holds the whole on the device); each
    of ``DENOISERS`` alike (Wan 2.2's second expert). The
    components named in ``skip`` are not loaded at all. Weights load from
    safetensors only (dpserve.worker.paths): a component that has only pickle
    checkpoints is refused.
    """
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"{path} is not a diffusers pipeline folder (no model_index.json)")
    for component in sorted(c for c in path.iterdir() if c.is_dir()):
        problem = pickle_problem(component, "model")
        if problem is not None:
            raise ValueError(f"{component}: {problem.fields[0].message}")
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    given: dict[str, Any] = dict(skip or {})
    for name in DENOISERS:
        cls = component_class(path, name)
        if cls is not None and name not in given:
            transformer = read(path / name, cls, dtype)
            if transformer is not None:
                given[name] = transformer
    read_ones = set(given)
    # Through the pipeline's own class: DiffusionPipeline's drops a module passed for a
    # component its class calls optional (WanPipeline's transformer) and loads it whole.
    index = json.loads((path / "model_index.json").read_text())
    named = getattr(diffusers, str(index.get("_class_name")), None)
    loader: Any = DiffusionPipeline
    if isinstance(named, type) and issubclass(named, DiffusionPipeline):
        loader = named
    pipe = loader.from_pretrained(
        path, dtype=dtype, local_files_only=True, use_safetensors=True, **given
    )
    pipe.set_progress_bar_config(disable=True)
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if name not in read_ones and isinstance(module, torch.nn.Module):
            prepare(module)
    pipe = pipe.to(device)
    for module in modules_of(pipe.components).values():
        own_storage(module)
    return pipe


def component_class(path: Path, name: str) -> Any | None:
    """The diffusers class that ``model_index.json`` names for component ``name``
    (None: no such component, or not a diffusers model class)."""
    entry = json.loads((path / "model_index.json").read_text()).get(name)
    if not isinstance(entry, list) or len(entry) != 2 or entry[0] != "diffusers":
        return None
    cls = getattr(diffusers, str(entry[1]), None)
    return cls if isinstance(cls, type) and issubclass(cls, ModelMixin) else None


def size_factor(pipe: Pipeline) -> int:
    """Width and height must be multiples of this: latent packing doubles the VAE
    factor (Flux); a video transformer's patch multiplies its VAE's spatial factor
    (Wan: 8 x 2)."""
    spatial = getattr(pipe, "vae_scale_factor_spatial", None)
    if spatial is not None:
        config = getattr(getattr(pipe, "transformer", None), "config", None)
        patch = getattr(config, "patch_size", None) or (1,)
        return int(spatial) * max(int(side) for side in patch[-2:])
    vae_factor = int(getattr(pipe, "vae_scale_factor", 8))
    return vae_factor * 2 if hasattr(pipe, "_pack_latents") else vae_factor


def pipe_output(result: Any) -> Any:
    """A pipeline call's output: a video pipeline's ``frames``, else ``images``."""
    frames = getattr(result, "frames", None)
    return frames if frames is not None else result.images


def call_defaults(pipe: Pipeline) -> dict[str, Any]:
    params = inspect.signature(pipe.__call__).parameters
    return {
        name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty
    }


def guides_by_scale(pipe: Pipeline) -> bool:
    """Whether ``guidance_scale`` is classifier-free guidance (Wan, SD3: a
    ``do_classifier_free_guidance`` property), not a distilled guidance embedding
    (Flux, Qwen-Image, whose CFG is ``true_cfg_scale``)."""
    return hasattr(type(pipe), "do_classifier_free_guidance") and (
        "true_cfg_scale" not in call_defaults(pipe)
    )


def cfg_report(defaults: Mapping[str, Any], by_guidance: bool) -> CostReport:
    """The pipeline's CFG defaults as the cost model reads them (dpserve.contract.cost)."""
    guidance = float(defaults.get("guidance_scale") or 1.0) if by_guidance else None
    return CostReport(
        default_true_cfg_scale=float(defaults.get("true_cfg_scale") or 1.0),
        default_guidance_scale=guidance,
    )


def cfg_requested(
    params: GenerateParams, defaults: Mapping[str, Any], by_guidance: bool = False
) -> bool:
    """Whether a step calls the denoiser twice (two CFG branches): true CFG needs a
    negative prompt and ``true_cfg_scale`` > 1; guidance CFG (``by_guidance``, see
    :func:`guides_by_scale`) needs ``guidance_scale`` > 1 (the pipeline's default
    when not given), the negative prompt optional. One rule with the router's cost."""
    return cfg_branches(params, cfg_report(defaults, by_guidance)) == 2


def pipeline_kwargs(
    params: GenerateParams, accepted: Mapping[str, Any], output_type: str
) -> dict[str, Any]:
    """Arguments for ``pipe(**kwargs)``; seeds become one CPU generator per image.

    CPU generators make the initial noise identical on every device and rank.
    """
    unsupported = [
        FieldError(field, "is not supported by this model's pipeline")
        for field, arg in _FIELD_ARGS.items()
        if getattr(params, field) is not None and arg not in accepted
    ]
    if unsupported:
        names = ", ".join(e.field for e in unsupported)
        raise RequestError(UNSUPPORTED, f"unsupported fields for this model: {names}", unsupported)
    if params.seed is None:
        raise RequestError(INVALID_REQUEST, "seeds must be fixed before a request reaches the gang")
    kwargs: dict[str, Any] = {
        "prompt": params.prompt,
        "num_images_per_prompt": params.n,
        "generator": [torch.Generator("cpu").manual_seed(s) for s in params.seed],
        "output_type": output_type,
    }
    for field, arg in _FIELD_ARGS.items():
        value = getattr(params, field)
        if value is not None:
            kwargs[arg] = value
    return kwargs
