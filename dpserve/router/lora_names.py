"""Which path each LoRA adapter name stands for, so a request may name one alone.

The router resolves a name given alone to its path before it sends the request, so
whichever replica runs it can load it (docs/lora.md, Names). A name is known from,
first to last:

- ``registered``: the router's ``--lora NAME=PATH`` (CRD ``spec.router.loras``);
- ``service``: the service's own adapters (``set_lora`` nicknames in the control state);
- ``sent``: a name with a path that this router's requests carried, once one was answered;
- ``replica``: names the replicas report having loaded (their pings' ``known``).

A name is bound to one path: a request giving a known name with another path is a 400
naming both. The first source that knows a name is the one its path comes from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from dpserve.contract import protocol as p
from dpserve.contract import validation as pv
from dpserve.contract.control_state import StateDoc
from dpserve.router.membership import Membership

REGISTERED, SERVICE, SENT, REPLICA = "registered", "service", "sent", "replica"
# The sources every tenant may see the names of (/v1/models): the service's catalog.
CATALOG: Final = frozenset({REGISTERED, SERVICE})
# Names learned from requests, oldest out past this: clients choose them.
MAX_SENT_NAMES: Final = 4096


@dataclass(frozen=True)
class KnownAdapter:
    name: str
    path: str
    source: str  # REGISTERED, SERVICE, SENT or REPLICA


class LoraNames:
    def __init__(
        self,
        registered: Mapping[str, str],
        members: Membership,
        desired: Callable[[], StateDoc | None],
        max_sent: int = MAX_SENT_NAMES,
    ) -> None:
        self._registered = dict(registered)
        self._max_sent = max_sent
        self._members = members
        self._desired = desired
        self._sent: dict[str, str] = {}  # in the order learned

    def _sources(self) -> Iterator[tuple[str, Mapping[str, str]]]:
        yield REGISTERED, self._registered
        doc = self._desired()
        yield SERVICE, doc.state.loras if doc is not None else {}
        yield SENT, self._sent
        for replica in self._members.members():
            if replica.adapters is not None:
                yield REPLICA, replica.adapters.known

    def find(self, name: str) -> KnownAdapter | None:
        for source, paths in self._sources():
            path = paths.get(name)
            if path is not None:
                return KnownAdapter(name, path, source)
        return None

    def known(self) -> list[KnownAdapter]:
        """Every known name, once, with the path its first source gives, by name."""
        seen: dict[str, KnownAdapter] = {}
        for source, paths in self._sources():
            for name, path in paths.items():
                seen.setdefault(name, KnownAdapter(name, path, source))
        return [seen[n] for n in sorted(seen)]

    def resolve(self, params: p.GenerateParams) -> p.GenerateParams:
        """``params`` with every adapter's path filled in; a name alone that no source
        knows, or a known name with another path, is a 400 that names it."""
        refs = self.resolve_refs(params.lora)
        return params if refs is params.lora else msgspec.structs.replace(params, lora=refs)

    def resolve_refs(self, refs: Sequence[p.LoraRef] | None) -> list[p.LoraRef] | None:
        if refs is None:
            return None
        doc = self._desired()
        if doc is not None and doc.state.merged is not None:
            raise p.RequestError(
                p.CONFLICT,
                "the service's adapters are merged into the weights, so a request's own "
                "lora cannot set them aside: POST /v1/unmerge_lora_weights first",
            )
        problems: list[p.FieldError] = []
        out: list[p.LoraRef] = []
        for ref in refs:
            known = self.find(ref.name)
            if known is None and ref.path is None:
                problems.append(p.FieldError("lora", _unknown(ref.name)))
            elif known is not None and ref.path is not None and ref.path != known.path:
                problems.append(p.FieldError("lora", _conflict(ref.name, ref.path, known)))
            elif known is not None and ref.path is None:
                out.append(msgspec.structs.replace(ref, path=known.path))
            else:
                out.append(ref)
        if problems:
            raise pv.invalid_fields(problems)
        return out

    def learn(self, refs: Sequence[p.LoraRef] | None) -> None:
        """A request with these adapters was answered: a new name with a path is known."""
        for ref in refs or ():
            if ref.path is None or self.find(ref.name) is not None:
                continue
            self._sent[ref.name] = ref.path
            if len(self._sent) > self._max_sent:
                del self._sent[next(iter(self._sent))]


def _unknown(name: str) -> str:
    return (
        f"adapter {name!r} is not known to this service: give its path "
        f'({{"name": "{name}", "path": ...}}), or have it registered '
        f"(--lora {name}=PATH, spec.router.loras)"
    )


def _conflict(name: str, path: str, known: KnownAdapter) -> str:
    return (
        f"adapter {name!r} is {known.path!r} here ({known.source}), not {path!r}: "
        "give a new name for another adapter"
    )
