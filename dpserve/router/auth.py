"""API keys, and the ASGI middleware that asks each request for the key its route needs.

Which key a route needs is declared with the route (dpserve/router/access.py); the
policy is pure (``Keys.verdict``, ``cross_site``); the middleware only reads the
``Authorization`` header and answers a refusal in OpenAI's error shape. Keys are
held as SHA-256 digests and compared with ``hmac.compare_digest``: the same work
for every configured key whatever matched, and no length leak. Keys are never
logged or echoed: refusals say how to send one, not what was sent.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from dpserve.router.access import ADMIN, INFERENCE, OPEN, Access, Levels
from dpserve.router.hosts import AllowedHosts
from dpserve.router.openai_api import error_body
from dpserve.router.request_ids import of_scope
from dpserve.router.tenants import (
    ANONYMOUS,
    KEYLESS,
    PRESENTED_KEY,
    SCOPE_KEY,
    Principal,
    TenantKey,
    check_tenant,
    tenant_key,
)

HOW_TO_SEND: Final = "send it as the header `Authorization: Bearer <key>`"


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


def _digest(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def _match(presented: bytes, known: tuple[tuple[bytes, str], ...]) -> str | None:
    """The tenant of the key whose digest is ``presented``, compared with every key
    without stopping at a match."""
    found = None
    for digest, tenant in known:
        if hmac.compare_digest(presented, digest):
            found = tenant
    return found


@dataclass(frozen=True, repr=False)
class Keys:
    """The configured keys, as digests, each with its tenant (dpserve/router/tenants.py)."""

    api: tuple[tuple[bytes, str], ...] = ()
    admin: tuple[tuple[bytes, str], ...] = ()

    @classmethod
    def of(cls, api: Iterable[str | TenantKey], admin: Iterable[str | TenantKey]) -> Keys:
        def digests(keys: Iterable[str | TenantKey]) -> tuple[tuple[bytes, str], ...]:
            return tuple((_digest(k.key), k.tenant) for k in map(tenant_key, keys))

        return cls(digests(api), digests(admin))

    @property
    def enabled(self) -> bool:
        return bool(self.api or self.admin)

    @property
    def tenants(self) -> tuple[str, ...]:
        """Every configured tenant, sorted: the only ones anything is labelled with."""
        return tuple(sorted({tenant for _, tenant in (*self.api, *self.admin)}))

    def __repr__(self) -> str:
        return f"Keys(api={len(self.api)}, admin={len(self.admin)})"

    def verdict(self, needed: Access, authorization: bytes | None) -> Refusal | Principal:
        """Who a request for a route at level ``needed`` acts for; else how to refuse it."""
        if not self.enabled:
            return KEYLESS
        if needed == OPEN:
            return ANONYMOUS
        if needed == ADMIN and not self.admin:
            return Refusal(
                403,
                "no admin key is configured, so control routes are closed: "
                "start the router with --admin-key or --admin-key-file",
            )
        token = bearer(authorization)
        if token is None:
            return Refusal(401, f"this route needs an API key: {HOW_TO_SEND}")
        presented = _digest(token)
        as_admin = _match(presented, self.admin)
        as_api = _match(presented, self.api)
        if as_admin is not None:
            return Principal(as_admin, sees_all=True)
        if needed == INFERENCE and as_api is not None:
            return Principal(as_api, sees_all=False)
        if needed == ADMIN and as_api is not None:
            return Refusal(403, "this key may only call inference routes; use an admin key")
        return Refusal(401, f"the API key is not valid: {HOW_TO_SEND}")

    def identify(self, authorization: bytes | None) -> Principal | None:
        """Who a key presented to a route that needs none acts for (a stored image's);
        None without keys configured, or without a valid key."""
        if authorization is None or not self.enabled:
            return None
        found = self.verdict(INFERENCE, authorization)
        return found if isinstance(found, Principal) else None


def bearer(authorization: bytes | None) -> bytes | None:
    """The token of ``Bearer <token>`` (scheme case-insensitive), else None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


def _header(scope: Any, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


# Methods a browser sends cross-site only without side effects here (the GETs with a
# body are read-only ops, and a browser cannot send a GET with a body).
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
# What a browser says of a request another site made it send (Fetch Metadata).
_FOREIGN_SITES: Final = frozenset({b"cross-site", b"same-site"})


def cross_site(scope: Any, needed: Access) -> Refusal | None:
    """A refusal for what a browser sends on another site's behalf, else None.

    A page elsewhere can make a browser POST without a preflight when the body is
    empty (``fetch(url, {method: "POST", mode: "no-cors"})``), and open a WebSocket to
    any address: neither is stopped by JSON-only bodies, and without keys nothing else
    stops them. Browsers say where such a request comes from (``Sec-Fetch-Site``, and
    ``Origin`` on every POST and WebSocket); other clients send neither, so refusing a
    foreign one costs no API client anything.
    """
    if scope["type"] == "http" and scope.get("method") in _SAFE_METHODS:
        return None
    if needed == OPEN:
        return None
    site = _header(scope, b"sec-fetch-site")
    if site is not None:  # the browser's own word, which no page can forge
        foreign = site.lower() in _FOREIGN_SITES
    else:  # an older browser: its Origin against the address it was sent to
        origin, host = _header(scope, b"origin"), _header(scope, b"host")
        foreign = origin is not None and _origin_host(origin) != (host or b"").lower()
    if not foreign:
        return None
    return Refusal(
        403,
        "cross-site browser requests are refused (their Origin is not this router): "
        "call the router from a server, a script, or a page it serves",
    )


def _foreign_host(scope: Any, hosts: AllowedHosts) -> Refusal | None:
    """421 for a ``Host`` the router is not known by (DNS rebinding, dpserve/router/hosts.py)."""
    why = hosts.refusal(scope)
    return None if why is None else Refusal(421, why)


def _origin_host(origin: bytes) -> bytes | None:
    """``host[:port]`` of an Origin header; None for ``null`` (an opaque origin) or junk."""
    scheme, sep, rest = origin.partition(b"://")
    if not sep or scheme not in (b"http", b"https", b"ws", b"wss") or not rest:
        return None
    return rest.rstrip(b"/").lower()


class AuthMiddleware:
    """Pure ASGI: refuses HTTP requests and WebSocket upgrades before the app sees them."""

    def __init__(self, app: Any, keys: Keys, levels: Levels, hosts: AllowedHosts) -> None:
        self.app = app
        self.keys = keys
        self.levels = levels
        self.hosts = hosts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        needed = self.levels.of_scope(scope)
        refusal = _foreign_host(scope, self.hosts) or cross_site(scope, needed)
        verdict = refusal or self.keys.verdict(needed, _header(scope, b"authorization"))
        if isinstance(verdict, Principal):
            scope[SCOPE_KEY] = verdict  # in place: the metrics middleware outside reads it
            if needed == OPEN:  # a key sent anyway says who asks (dpserve/router/tenants.py)
                scope[PRESENTED_KEY] = self.keys.identify(_header(scope, b"authorization"))
            await self.app(scope, receive, send)
            return
        refusal = verdict
        if scope["type"] == "http":
            await _refuse_http(scope, send, refusal)
        else:
            await _refuse_websocket(scope, send, refusal)


def _refusal_response(scope: Any, refusal: Refusal) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(error_body(refusal.status, refusal.message, None, of_scope(scope))).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if refusal.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers, body


async def _refuse_http(scope: Any, send: Any, refusal: Refusal) -> None:
    headers, body = _refusal_response(scope, refusal)
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _refuse_websocket(scope: Any, send: Any, refusal: Refusal) -> None:
    """Never accepted: the upgrade gets the HTTP refusal where the server can send one
    (ASGI's websocket.http.response extension, which uvicorn has), else close 1008."""
    if "websocket.http.response" in scope.get("extensions", {}):
        headers, body = _refusal_response(scope, refusal)
        start = {"type": "websocket.http.response.start", "status": refusal.status}
        await send({**start, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.close", "code": 1008, "reason": refusal.message[:120]})


def load_key_file(path: Path) -> tuple[TenantKey, ...]:
    """One key a line, alone (its own tenant) or after the name of the tenant it belongs
    to (``team-a sk-...``); blank lines and ``#`` comments are skipped.

    Raises ValueError with a message naming the file (never a key) when it cannot
    be read, holds a key that no HTTP header can carry, or lists a key twice.
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read key file {path}: {exc}") from None
    keys: dict[str, TenantKey] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"{path} line {number}"
        if len(words) > 2:
            raise ValueError(f"{where}: write a key alone, or a tenant name and the key")
        key = check_key(words[-1], where)
        if key in keys:
            raise ValueError(f"{where}: this key is listed twice")
        tenant = check_tenant(words[0], where) if len(words) == 2 else None
        keys[key] = TenantKey(key, tenant) if tenant else tenant_key(key)
    return tuple(keys.values())


def check_key(key: str, where: str) -> str:
    """A key must be sendable as a Bearer token: printable ASCII, no spaces."""
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        raise ValueError(f"{where}: an API key must be printable ASCII without spaces")
    return key


def document_security(schema: dict[str, Any], levels: Levels) -> dict[str, Any]:
    """The OpenAPI schema with its Bearer scheme on every operation that needs a key
    (so /docs has an Authorize button), in place."""
    components = schema.setdefault("components", {})
    components.setdefault("securitySchemes", {})["bearer"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key; control routes need an admin key",
    }
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if isinstance(operation, dict) and levels.of_path(path, method.upper()) != OPEN:
                operation["security"] = [{"bearer": []}]
    return schema
