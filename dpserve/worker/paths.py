"""Which folders a control op may load from, and which files it may load: the policy.

``update_weights_from_disk`` and ``set_lora`` name folders on the replica's disk.
A folder is accepted only when its real path (``..`` and every symlink resolved)
lies under one of the replica's roots: the model folder and each ``--allow-path``.
Whatever the reason a path is refused (it does not exist, it is a file, it leaves
the roots by ``..`` or a symlink, it is relative), the answer is the same words,
so a caller learns nothing about what exists outside the roots. The check runs on
the resolved path, and the loaders are given that resolved path, so a symlink
swapped after the check cannot redirect the load outside.

Files inside an accepted folder are not resolved again: a Hugging Face cache's
snapshot folder is made of symlinks into its ``blobs`` folder, and whoever can
write into an allowed root is trusted with it.

Weights load from safetensors only: a pickle checkpoint can run code when it is
read, so a folder that offers nothing but pickles is refused by name here, and the
loaders are told ``use_safetensors=True`` (which never falls back to a pickle).
Torch-free, so it is tested on its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dpserve.contract.control_state import bad
from dpserve.contract.protocol import (
    RequestError,
)

# One text for every refusal, whatever the cause (see the module's docstring).
REFUSED: Final = (
    "is not an allowed folder: give the absolute path of an existing folder under "
    "the replica's model folder or one of its --allow-path folders"
)
# Checkpoint formats that are Python pickles (torch.save and friends).
PICKLE_SUFFIXES: Final = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})


@dataclass(frozen=True)
class AllowedPaths:
    roots: tuple[Path, ...]  # real paths

    @classmethod
    def of(cls, model: Path, extra: Iterable[Path] = ()) -> AllowedPaths:
        """The model folder and the ``--allow-path`` folders, resolved once at start-up."""
        return cls(tuple(Path(os.path.realpath(p)) for p in (model, *extra)))

    def folder(self, raw: str, field_name: str) -> Path:
        """The real path of ``raw`` when it is a folder under a root; else one refusal."""
        try:
            if not os.path.isabs(raw):
                raise ValueError(raw)
            real = Path(os.path.realpath(raw))
        except (ValueError, OSError):  # a NUL byte, an unreadable or looping path
            raise bad(field_name, REFUSED) from None
        if not any(real.is_relative_to(root) for root in self.roots) or not real.is_dir():
            raise bad(field_name, REFUSED)
        return real


def pickle_problem(folder: Path, field_name: str) -> RequestError | None:
    """A refusal when ``folder`` holds weights only as pickle checkpoints, else None."""
    try:
        files = [f for f in folder.iterdir() if f.is_file()]
    except OSError:
        return None  # the loader says what is wrong with it
    if any(f.suffix == ".safetensors" for f in files):
        return None  # loaded with use_safetensors=True: the pickles beside it are never read
    pickles = sorted(f.name for f in files if f.suffix in PICKLE_SUFFIXES)
    if not pickles:
        return None
    return bad(
        field_name,
        f"holds pickle checkpoints ({', '.join(pickles)}) and no .safetensors file: dpserve "
        "loads safetensors only, since reading a pickle can run code; convert them "
        "(e.g. safetensors.torch.save_file of the state dict) and retry",
    )


def refuse_pickles(folder: Path, field_name: str) -> None:
    problem = pickle_problem(folder, field_name)
    if problem is not None:
        raise problem
