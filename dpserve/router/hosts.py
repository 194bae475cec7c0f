"""Which ``Host`` a request may name: the guard against DNS rebinding.

A page on evil.example can have its name re-resolved to 127.0.0.1 (or to any
address the victim's browser reaches) and then call the router as *its own* origin:
same-origin for the browser, so neither JSON-only bodies nor Fetch Metadata stop it,
and with no keys nothing else does. What such a request cannot hide is the name it
was sent to: the browser's ``Host`` is evil.example. So the router answers only the
names it is known by (docs/router.md, Security):

- loopback names: ``localhost`` and ``*.localhost`` (browsers resolve those to
  loopback themselves, never by DNS);
- any IP literal: no DNS answer is involved in reaching one, so it cannot be rebound,
  and pod IPs, load balancers' addresses and probes all arrive as IP literals;
- the names given (``--allowed-host``, repeatable; on Kubernetes the operator gives
  the router Service's names) and ``--public-url``'s host (by default the bound one);
- everything, with ``--allowed-host '*'``.

A request without ``Host`` (HTTP/1.0) is let through: every browser sends one.
Ports are not compared: the attacker's page must use the router's port anyway.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

ANY: Final = "*"
LOOPBACK_NAME: Final = "localhost"


def normal(host: str) -> str:
    """``host[:port]`` as compared: the name or address alone, lower case, no
    trailing dot, an IPv6 literal without its brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        host = name
    return host.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AllowedHosts:
    names: frozenset[str] = frozenset()
    any: bool = False

    @classmethod
    def of(cls, given: Iterable[str], public_url: str | None = None) -> AllowedHosts:
        """The names given (``*``: every one) and ``public_url``'s host."""
        names = {normal(name) for name in given}
        if public_url:
            names.add(normal(urlsplit(public_url).netloc.rpartition("@")[2]))
        return cls(frozenset(n for n in names if n and n != ANY and not _is_ip(n)), ANY in names)

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:
            return True
        name = normal(host)
        return (
            name == LOOPBACK_NAME
            or name.endswith("." + LOOPBACK_NAME)
            or name in self.names
            or _is_ip(name)
        )

    def refusal(self, scope: Any) -> str | None:
        """Why a request (HTTP or WebSocket) is refused for its ``Host``, else None."""
        host = None
        for key, value in scope.get("headers", ()):
            if key.lower() == b"host":
                host = bytes(value).decode("latin-1")
                break
        if self.allows(host):
            return None
        return (
            f"this router does not answer to the host {normal(host or '')[:100]!r} (a page whose "
            "name was re-pointed at it could be calling): call it by an IP address or "
            "localhost, or start it with --allowed-host NAME (spec.router.allowedHosts "
            "in a DiffusionService; '*' allows any)"
        )
