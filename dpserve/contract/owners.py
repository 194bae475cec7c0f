"""Whose work it is: the one rule every side applies (docs/tenants.md, "Ownership").

Work a request leaves behind (a video job, a realtime session, a generation a cancel
names) is recorded, where it lives, with the tenant that sent it. Who asks about it
later is a *scope*: a tenant's name, which sees that tenant's work only, or None,
which sees every tenant's (an admin key, a router without keys, a router's own
housekeeping, and peers that predate tenants, so an old sender keeps working).
Work another tenant owns is answered as if it did not exist, never "forbidden":
a refusal that differs would tell an id's owner apart from an unknown id.
"""

from __future__ import annotations


def may_see(scope: str | None, owner: str) -> bool:
    """May a caller of ``scope`` see, change or cancel work recorded for ``owner``?"""
    return scope is None or scope == owner
