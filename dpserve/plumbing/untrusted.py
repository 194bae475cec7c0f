"""Checks on decoded client input that the decoders themselves do not make.

Shared by the router's JSON bodies and the realtime WebSocket's msgpack messages:
no request field is nested more than a few levels, so anything deeper is an
attack on the decoder or on code that walks the value recursively.
"""

from __future__ import annotations

from typing import Any, Final

MAX_DEPTH: Final = 32


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists/maps more than ``limit`` levels (a scalar is level 0).

    Iterative, so a hostile value cannot exhaust the interpreter's stack here.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth + 1 > limit:
            return True
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, dict | list | tuple)
        )
    return False
