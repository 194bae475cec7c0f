"""The served model's name (vLLM's ``--served-model-name``) and the check every route that
takes a ``model`` makes: leaving it out is fine, naming another model is a 404
``model_not_found`` (as SGLang answers), so a client pointed at the wrong service
finds out at once instead of getting another model's images.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract.model_info import ModelInfo

MODEL_NOT_FOUND: Final = "model_not_found"  # OpenAI's and SGLang's error.code
MAX_NAME_CHARS: Final = 256
UNKNOWN: Final = "dpserve"  # listed until a replica says which model it serves


_NAME: Final = re.compile(rf"[!-~]{{1,{MAX_NAME_CHARS}}}")  # the CRD's pattern too


def check_name(name: str) -> str:
    """A served name any client can send: 1-256 printable ASCII characters, no spaces."""
    if _NAME.fullmatch(name) is None:
        raise ValueError(
            f"a served model name must be 1-{MAX_NAME_CHARS} printable ASCII characters "
            f"without spaces, got {name[:40]!r}"
        )
    return name


def served_name(configured: str | None, infos: Iterable[ModelInfo]) -> str | None:
    """The name given at start-up, else the model folder's name a replica reports;
    None while neither is known (no replica has answered yet)."""
    if configured:
        return configured
    for info in infos:
        if Path(info.model_path).name:
            return Path(info.model_path).name
    return None


def model_not_found(asked: str, served: str) -> p.RequestError:
    return p.RequestError(
        MODEL_NOT_FOUND,
        f"the model {asked[:80]!r} is not served here; this service serves {served!r} "
        "(GET /v1/models): send that name, or leave model out",
        [p.FieldError("model", f"must be {served!r} or left out")],
        status=404,
    )


def check_model(asked: Any, served: str | None) -> None:
    """Refuse a request naming another model (None: not known yet; the request then
    waits for a replica like any other, and the replica serves its one model)."""
    if asked is None:
        return
    if not isinstance(asked, str):
        raise pv.invalid_fields(
            [p.FieldError("model", f"must be a string, got {type(asked).__name__}")]
        )
    if served is not None and asked != served:
        raise model_not_found(asked, served)
