"""Tenants: whose work a request is, from the key it was sent with (docs/tenants.md).

A tenant is a name that owns work (video jobs, realtime sessions, stored images,
requests to cancel) and gets a fair share of the replicas. Each key is its own
tenant unless a key file names the tenant it belongs to (``<tenant> <key>`` on a
line), so several keys (a team's, rotated ones) can share one. A key given alone is
named by its digest (``key-`` and 12 hex digits): never the key itself, which would
land in metrics and logs. Tenants are only ever the configured ones, so anything
labelled by tenant has a bounded number of series.

Admin keys see every tenant's work. Without keys every caller is one tenant that
sees everything: the single-user quick start, as before tenants existed.

The auth middleware (dpserve/router/auth.py) puts each request's :class:`Principal`
in its ASGI scope; handlers read it with :func:`principal_of`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Final

from dpserve.contract.owners import may_see

# A tenant's name goes into metric labels, logs, job records and file paths.
_NAME: Final = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
SCOPE_KEY: Final = "dpserve.principal"
PRESENTED_KEY: Final = "dpserve.presented"


@dataclass(frozen=True, repr=False)
class TenantKey:
    """A key and the tenant it belongs to."""

    key: str
    tenant: str

    def __repr__(self) -> str:
        return f"TenantKey(tenant={self.tenant!r})"


def unnamed(key: str) -> str:
    """The tenant of a key no file names: its digest's first 12 hex digits."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def tenant_key(key: str | TenantKey) -> TenantKey:
    """A configured key with its tenant (a bare key is its own)."""
    return key if isinstance(key, TenantKey) else TenantKey(key, unnamed(key))


def check_tenant(name: str, where: str) -> str:
    if not _NAME.match(name):
        raise ValueError(
            f"{where}: a tenant name is 1-63 lowercase letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the tenant it acts for, and whether it sees every tenant's
    work (an admin key, or a router without keys)."""

    tenant: str
    sees_all: bool

    @property
    def scope(self) -> str | None:
        """What the replicas are told of the caller: its tenant, or None to see all."""
        return None if self.sees_all else self.tenant

    def owns(self, tenant: str | None) -> bool:
        """May this caller see work recorded for ``tenant``?"""
        return self.sees_all if tenant is None else may_see(self.scope, tenant)


# Without keys: everyone is one tenant, which sees everything.
KEYLESS: Final = Principal("default", sees_all=True)
# A route that needs no key (probes, stored images, docs): nobody in particular.
ANONYMOUS: Final = Principal("", sees_all=False)


def presented_of(scope: Any) -> Principal | None:
    """On a route that needs no key: who the key sent anyway acts for; None when none
    (or no valid one) was sent."""
    found = scope.get(PRESENTED_KEY)
    return found if isinstance(found, Principal) else None


def may_open(presented: Principal | None, tenant: str | None) -> bool:
    """May a link to a stored image of ``tenant`` be opened? Without a key, yes: the
    link is the capability, as a presigned URL is. With a key, only its own tenant's
    (or an admin's): a client of one tenant never reads another's by mistake."""
    return presented is None or presented.owns(tenant)


def principal_of(scope: Any) -> Principal:
    """The request's principal, as the auth middleware set it (KEYLESS for an app
    mounted without it, as some in-process tests do)."""
    found = scope.get(SCOPE_KEY)
    return found if isinstance(found, Principal) else KEYLESS
