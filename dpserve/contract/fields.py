"""A request field as one row of a table: the parsers' known fields and the router's
request models (/openapi.json) both come from these rows, so a field's name, type and
bounds are written once.

The tables are the parsers' own (``validation.GENERATE_SPECS``, ``video.VIDEO_SPECS``);
the router adds the fields it reads itself before the parser and builds its pydantic
models from both (dpserve/router/fields.py). This module stays plain Python: the
contract imports neither side's libraries.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldSpec:
    """One field of a request body as a client sends it.

    ``type`` is the annotation of a JSON body's value (None among its members: the
    field may be null, which is the same as leaving it out). The bounds are the ones
    the parser checks under the default ``Limits``; a replica's own limits can narrow
    them, which the route's 400 then names.
    """

    name: str
    type: Any
    default: Any = None
    required: bool = False
    description: str | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    max_length: int | None = None


def names(specs: Iterable[FieldSpec]) -> frozenset[str]:
    return frozenset(spec.name for spec in specs)
