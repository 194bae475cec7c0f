"""Which files of a repository a diffusers pipeline needs: the policy, pure.

A pipeline folder is ``model_index.json`` and one folder per component it names
(``"vae": ["diffusers", "AutoencoderKL"]``); a component named ``[null, null]`` is
absent. From each component folder: its configs (``*.json``), its weights as
safetensors (shards with their index), its tokenizer files (``*.txt``, ``*.model``,
``*.jinja``, ``*.tiktoken``). Never:

- pickles (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``): reading one can
  run code; a component whose weights are only pickles is refused by name;
- other frameworks' weights (ONNX, Flax msgpack, Keras h5, OpenVINO, GGUF) and
  indexes of weights not fetched;
- files at the repository's root beside ``model_index.json``: the single-file
  checkpoints (``flux1-dev.safetensors``) that duplicate the components;
- folders no component names (ComfyUI's ``text_encoders/``, examples, assets);
- a precision variant (``model.fp16.safetensors``) where the plain file exists; where
  only variants exist, the one variant there is (two or more: refused, naming them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from dpserve.sources.errors import SourceError

INDEX: Final = "model_index.json"
PICKLES: Final = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
FOREIGN: Final = (".onnx", ".onnx_data", ".msgpack", ".h5", ".pb", ".tflite", ".gguf", ".xml")
TOKENIZER: Final = (".txt", ".model", ".jinja", ".tiktoken")
# base[.variant][-00001-of-00003].safetensors, and its index base.safetensors.index[.variant].json
_WEIGHTS = re.compile(
    r"^(?P<base>[^.]+?)(?:\.(?P<variant>[A-Za-z0-9_]+))?(?:-\d+-of-\d+)?\.safetensors$"
)
_INDEX = re.compile(
    r"^(?P<base>[^.]+)\.(?P<kind>\w+)\.index(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json$"
)


class NotAPipeline(SourceError):
    pass


@dataclass(frozen=True)
class Selection:
    files: tuple[str, ...]  # repository paths, sorted
    components: tuple[str, ...]  # the component folders, in model_index order


def components(model_index: Mapping[str, object]) -> tuple[str, ...]:
    """The component folders ``model_index.json`` names (present ones only)."""
    out = []
    for name, value in model_index.items():
        if name.startswith("_") or not isinstance(value, list | tuple) or len(value) != 2:
            continue  # "_class_name", and scalar settings such as Wan's "boundary_ratio"
        if value[0] is None or value[1] is None:
            continue  # an optional component the pipeline does without
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in (".", ".."):
            raise NotAPipeline(f"{INDEX} names a component {name!r} that is no folder name")
        out.append(name)
    return tuple(out)


def read_index(text: bytes | str) -> dict[str, object]:
    try:
        index = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotAPipeline(f"{INDEX} is not JSON ({exc}): is this a diffusers pipeline?") from None
    if not isinstance(index, dict) or "_class_name" not in index:
        raise NotAPipeline(f"{INDEX} has no _class_name: is this a diffusers pipeline?")
    return index


def select(paths: Iterable[str], model_index: Mapping[str, object]) -> Selection:
    """The files to fetch of a repository holding ``paths`` (relative, '/'-separated)."""
    paths = set(paths)
    if INDEX not in paths:
        raise NotAPipeline(
            f"no {INDEX} at the top: a model source must be a diffusers pipeline folder "
            "(what `DiffusionPipeline.save_pretrained` writes)"
        )
    wanted = [INDEX]
    names = components(model_index)
    for name in names:
        inside = sorted(p[len(name) + 1 :] for p in paths if p.startswith(name + "/"))
        wanted += [f"{name}/{p}" for p in _component_files(name, inside)]
    return Selection(tuple(sorted(wanted)), names)


def _component_files(name: str, files: list[str]) -> list[str]:
    keep = [f for f in files if f.endswith(".json") or f.endswith(TOKENIZER)]
    weights = [f for f in files if f.endswith(".safetensors")]
    others = [f for f in files if f.endswith(PICKLES + FOREIGN)]
    if others and not weights:
        raise NotAPipeline(
            f"component {name!r} has weights only as {', '.join(others[:4])}"
            f"{' …' if len(others) > 4 else ''}: dpserve loads safetensors only (a pickle "
            "can run code when read); convert it (safetensors.torch.save_file of the state "
            "dict, or diffusers' save_pretrained) and upload the .safetensors files"
        )
    chosen = _one_variant(name, weights)
    indexes = []
    for f in keep:
        index = _INDEX.match(f.rsplit("/", 1)[-1])
        if index is None:
            indexes.append(f)  # a config or tokenizer file
        elif index["kind"] == "safetensors" and (index["base"], index["variant"]) in chosen:
            indexes.append(f)  # the index of shards fetched; others index what is not
    return indexes + [f for f in weights if _key(f) in chosen]


def _key(path: str) -> tuple[str, str | None]:
    matched = _WEIGHTS.match(path.rsplit("/", 1)[-1])
    if matched is None:  # a name outside diffusers' scheme: its own weights, plain
        return (path, None)
    return (matched["base"], matched["variant"])


def _one_variant(name: str, weights: list[str]) -> set[tuple[str, str | None]]:
    """Per weights base name: the plain files where they exist, else the one variant."""
    by_base: dict[str, set[str | None]] = {}
    for f in weights:
        base, variant = _key(f)
        by_base.setdefault(base, set()).add(variant)
    chosen: set[tuple[str, str | None]] = set()
    for base, variants in by_base.items():
        if None in variants:
            chosen.add((base, None))
        elif len(variants) == 1:
            chosen.add((base, next(iter(variants))))
        else:
            listed = ", ".join(sorted(v for v in variants if v))
            raise NotAPipeline(
                f"component {name!r} has {base} only as precision variants ({listed}) and no "
                "plain file: upload one of them without the variant in its name"
            )
    return chosen
