"""The control state every replica converges to: weights source, LoRA adapters, memory.

A state-changing control op (SGLang's names) is a change to this state
(:func:`reduce`); a replica is sent the whole resulting state and brings itself
there, so applying is idempotent and needs no history: a replica that missed
ops, restarted, or meets a new router gets one call whatever happened before.

States travel in documents ordered by ``(version, id)``. Each op makes the next
version; the id (random) orders two routers that raced for the same version.
Every router adopts the greatest document it sees — in its store, or held by a
replica — so routers never undo each other's ops. A document also names the
newest one it was made knowing (``base``): a replica, or a store, takes an op's
document only over one it knows (:meth:`StateDoc.knows`), so an op built on a
stale state is refused instead of replacing another router's newer one, and its
router builds it again on top (dpserve/router/service.py). This module is
torch-free: the router reduces ops and compares digests, the worker applies states.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from dpserve.contract.protocol import (
    INVALID_REQUEST,
    SYNC_STATE,
    UNAVAILABLE,
    FieldError,
    RequestError,
)

# What an adapter reaches: "all", its transformer part and (where it has one) its text
# encoder part, diffusers' load_lora_weights. SGLang's "transformer" (the transformer
# part alone) is refused until a replica can load a part of an adapter (_target).
LORA_TARGETS: Final = ("all",)
# The denoisers: the transformer, and Wan 2.2's second expert (its low-noise one). A
# weight update that names no modules reloads both, so the experts never come from two
# checkpoints unasked; a replica whose model has one denoiser has no second to reload.
DENOISERS: Final = ("transformer", "transformer_2")


class WeightSource(msgspec.Struct, frozen=True):
    path: str
    # The version that asked for it: asking again for the same folder (new files
    # written there) is a new state, so it reloads.
    revision: int


class ControlState(msgspec.Struct, frozen=True, kw_only=True):
    weights: dict[str, WeightSource] = msgspec.field(default_factory=dict)  # absent: as booted
    loras: dict[str, str] = msgspec.field(default_factory=dict)  # nickname -> path, loaded
    active: dict[str, float] = msgspec.field(default_factory=dict)  # nickname -> strength
    merged: float | None = None  # the strength the active adapters are merged at
    released: bool = False

    def digest(self) -> str:
        return hashlib.sha256(_CANONICAL.encode(self)).hexdigest()[:16]


class StateDoc(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 0
    id: str = "boot"
    op: str = ""  # the op that made it, for people reading status
    state: ControlState = msgspec.field(default_factory=ControlState)
    # The key of the newest document its maker knew: every one up to there is in its
    # state, or lost a race to one that is. (-1, ""): none (the boot document).
    base: tuple[int, str] = (-1, "")

    @property
    def key(self) -> tuple[int, str]:
        return (self.version, self.id)

    def successor(self, op: str, state: ControlState) -> StateDoc:
        """The next document, made knowing this one (``state``: the op's change to it)."""
        return StateDoc(
            version=self.version + 1, id=uuid.uuid4().hex[:12], op=op, state=state, base=self.key
        )

    def knows(self, other: StateDoc) -> bool:
        """Whether this document may replace ``other``: it is ``other``, or was made
        knowing it (or something newer), so taking it undoes no op."""
        return other.key == self.key or other.key <= self.base

    def to_builtins(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


_CANONICAL: Final = msgspec.json.Encoder(order="sorted")


def newest(*docs: StateDoc | None) -> StateDoc | None:
    known = [d for d in docs if d is not None]
    return max(known, key=lambda d: d.key) if known else None


def stored_after(stored: StateDoc | None, offered: StateDoc) -> StateDoc:
    """What a store holds once ``offered`` is written with compare-and-swap: it, when it
    knows what is stored; else what is stored (another router's op won; build on it)."""
    return offered if stored is None or offered.knows(stored) else stored


def refusal(held: StateDoc, doc: StateDoc, op: str) -> str | None:
    """Why a replica holding ``held`` must not take ``doc`` (sent with ``op``); None: it may.

    A sync only brings a replica forward. An op's document must know what the replica
    holds: one built on an older state would undo the op that made the replica's.
    """
    if op == SYNC_STATE:
        if doc.key >= held.key:
            return None
        return f"this replica holds control state version {held.version}, newer than {doc.version}"
    if doc.knows(held):
        return None
    return (
        f"this replica holds control state version {held.version} ({held.op or 'boot'}), "
        f"which version {doc.version} was not made from: another router changed the state "
        "at the same time; retry"
    )


def parse_doc(raw: Any) -> StateDoc:
    """A document from JSON-like data; anything malformed raises ``ValueError``."""
    try:
        return msgspec.convert(raw, StateDoc)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a control state document: {exc}") from exc


# ---------------------------------------------------------------- argument checks


def bad(field_name: str, message: str, code: str = INVALID_REQUEST) -> RequestError:
    return RequestError(code, f"{field_name} {message}", [FieldError(field_name, message)])


def _text(args: Mapping[str, Any], name: str) -> str | None:
    value = args.get(name)
    if value is not None and not isinstance(value, str):
        raise bad(name, "must be a string")
    return value


def _number(args: Mapping[str, Any], name: str, default: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(name, "must be a number")
    return float(value)


def names(value: Any, field_name: str) -> list[str]:
    found = [value] if isinstance(value, str) else value
    if not isinstance(found, list) or not found or not all(isinstance(n, str) for n in found):
        raise bad(field_name, "must be a string or a non-empty list of strings")
    return found


def _resident(state: ControlState) -> None:
    if state.released:
        raise RequestError(
            UNAVAILABLE,
            "weights are released from the device; call resume_memory_occupation first",
        )


def _target(args: Mapping[str, Any]) -> None:
    target = args.get("target", "all")
    if target == DENOISERS[1]:
        raise bad(
            "target",
            "Wan 2.2's second expert (transformer_2) takes no adapters here: adapters adapt "
            "the first expert, transformer (diffusers' default; its load_into_transformer_2 "
            "is not offered); merge a low-noise adapter into that expert's weights and load "
            "them with update_weights_from_disk (modules: [transformer_2]) instead",
        )
    if target == "transformer":
        raise bad(
            "target",
            "'transformer' (an adapter's transformer part alone) is not offered: adapters "
            "load whole, their transformer part and, where they have one, their text encoder "
            "part; send target 'all' (the default), or an adapter without a text encoder part",
        )
    if target not in LORA_TARGETS:
        raise bad("target", f"must be one of {', '.join(LORA_TARGETS)}, got {target!r}")


# ---------------------------------------------------------------- ops as state changes


def reduce(state: ControlState, op: str, args: Mapping[str, Any], revision: int) -> ControlState:
    """The state after ``op``; a request the state refuses raises :class:`RequestError`.

    What only a replica can check (does the folder exist, does the adapter load)
    is checked when it applies the state.
    """
    if op == "release_memory_occupation":
        return msgspec.structs.replace(state, released=True)
    if op == "resume_memory_occupation":
        return msgspec.structs.replace(state, released=False)
    _resident(state)
    if op == "update_weights_from_disk":
        path = _text(args, "model_path")
        if not path:
            raise bad("model_path", "is required")
        modules = names(args.get("modules", list(DENOISERS)), "modules")
        source = WeightSource(path, revision)
        # Adapters belonged to the old modules: a weight update drops them.
        return ControlState(weights={**state.weights, **{m: source for m in modules}})
    _target(args)
    if op == "set_lora":
        return _set_lora(state, args)
    if op == "merge_lora_weights":
        if not state.active:
            raise bad("lora_nickname", "no active adapter to merge; call set_lora first")
        if state.merged is not None:
            raise bad("lora_nickname", "adapters are already merged")
        return msgspec.structs.replace(state, merged=_number(args, "strength", 1.0))
    if op == "unmerge_lora_weights":
        if state.merged is None:
            raise bad("lora_nickname", "no merged adapters to unmerge")
        return msgspec.structs.replace(state, merged=None)
    raise RequestError(INVALID_REQUEST, f"{op} does not change the control state")


def _set_lora(state: ControlState, args: Mapping[str, Any]) -> ControlState:
    """Load adapters (where a path is given) and make exactly these ones active."""
    nicknames = names(args.get("lora_nickname"), "lora_nickname")
    paths = args.get("lora_path")
    path_list = [None] * len(nicknames) if paths is None else names(paths, "lora_path")
    strengths = args.get("strength", 1.0)
    strength_list = strengths if isinstance(strengths, list) else [strengths] * len(nicknames)
    if len(path_list) != len(nicknames):
        raise bad("lora_path", "needs one path per nickname")
    if len(strength_list) != len(nicknames) or not all(
        isinstance(s, int | float) and not isinstance(s, bool) for s in strength_list
    ):
        raise bad("strength", "must be a number, or a list with one number per nickname")
    if state.merged is not None:
        raise bad("lora_nickname", "cannot change adapters while merged; unmerge first")
    loras = dict(state.loras)
    for nick, path in zip(nicknames, path_list, strict=True):
        if path is None and nick not in loras:
            raise bad("lora_path", f"is required: adapter {nick!r} is not loaded yet")
        if path is not None:
            loras[nick] = path
    active = {n: float(s) for n, s in zip(nicknames, strength_list, strict=True)}
    return msgspec.structs.replace(state, loras=loras, active=active)


def answer(op: str, args: Mapping[str, Any], state: ControlState) -> dict[str, Any]:
    """What an op's caller is told, read from the state it produced (SGLang's fields)."""
    if op == "update_weights_from_disk":
        return {
            "model_path": args.get("model_path"),
            "modules": names(args.get("modules", list(DENOISERS)), "modules"),
        }
    if op == "set_lora":
        return {"active": [{"nickname": n, "strength": s} for n, s in state.active.items()]}
    if op == "merge_lora_weights":
        return {"merged": list(state.active), "strength": state.merged}
    if op == "unmerge_lora_weights":
        return {"unmerged": list(state.active)}
    return {"released": state.released}
