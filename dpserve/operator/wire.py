"""Whether the service's wire Secret is the operator's own, without reading a Secret.

The operator holds ``create`` on Secrets and nothing else (docs/operator.md), so it
cannot look at a Secret's owner. It knows what it created: the create succeeded
(201), and it records the name in ``status.wireSecret`` at once. A create that finds
the name taken (409) is trusted only when that record says so. Anyone who may create
Secrets in the namespace could otherwise plant ``<name>-wire`` before the service's
first reconcile and hold the key to its wire; such a Secret is refused and reported,
and the service waits (no pod or router mounts it) until it is deleted.

Services reconciled by an operator from before the record (their status has a
``selector``, which the full status always carries, and no ``wireSecret``) made the
Secret at their first reconcile: it is adopted once and recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from dpserve.operator.plan import Note

RECORD: Final = "wireSecret"  # the status field naming the Secret the operator created
REFUSED: Final = "WireSecretNotOwned"  # the Degraded condition's reason and the Event's


def owned(name: str, created: bool, previous: Mapping[str, Any]) -> bool:
    """Whether the wire Secret ``name`` is this service's own: just ``created``, recorded
    as created, or made by an operator from before the record (see the module's note)."""
    if created or previous.get(RECORD) == name:
        return True
    return RECORD not in previous and bool(previous.get("selector"))


def refusal(namespace: str, name: str) -> Note:
    return Note(
        REFUSED,
        f"Secret {name} exists but the operator did not create it for this "
        "DiffusionService, so its key is not used: whoever made it could read and forge "
        "the service's traffic. Delete it (kubectl -n "
        f"{namespace} delete secret {name}) and the operator makes a new key; a Secret "
        "left by a deleted DiffusionService of the same name goes away by itself once "
        "garbage collection removes it.",
    )
