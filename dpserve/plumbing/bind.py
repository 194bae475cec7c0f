"""The ports a command will listen on, claimed before the slow part of its start.

A replica takes seconds to minutes to load its model; a port found taken only
after that has wasted all of it. ``dpserve serve`` and ``dpserve router`` bind their
HTTP sockets first and hand them to uvicorn (so nothing can take the port in
between); ``dpserve worker`` on a fixed port checks that ZMQ will be able to bind it.
Stdlib only: the CLI calls this before it imports anything heavy.
"""

from __future__ import annotations

import errno
import socket


class PortUnavailable(Exception):
    """A port cannot be bound; the message names it and says what to do."""


def _describe(host: str, port: int, flag: str, exc: OSError) -> str:
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} is taken ({where}): stop what holds it, or pick another {flag}"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot bind {where}: {host} is not an address of this machine"
    if exc.errno == errno.EACCES:
        return f"cannot bind {where}: ports below 1024 need privileges; pick another {flag}"
    return f"cannot bind {where}: {exc.strerror or exc}"


def _addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, tuple[object, ...]]]:
    """What asyncio's ``create_server`` would bind for ``host``: every address it
    resolves to ("localhost" may be both 127.0.0.1 and ::1), each once."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise PortUnavailable(f"cannot resolve the address {host!r}: {exc.strerror}") from None
    out: list[tuple[socket.AddressFamily, tuple[object, ...]]] = []
    for family, _, _, _, addr in infos:
        if (family, addr) not in out:
            out.append((family, addr))
    return out


def hold_tcp(host: str, port: int, flag: str = "--port") -> list[socket.socket]:
    """Bound (not yet listening) TCP sockets for ``host:port``, as uvicorn binds them
    (``SO_REUSEADDR``); the caller hands them to the server, or closes them.

    Raises PortUnavailable naming the port and ``flag`` (the option that sets it).
    """
    held: list[socket.socket] = []
    try:
        for family, addr in _addresses(host, port):
            sock = socket.socket(family, socket.SOCK_STREAM)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio does: each family its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                raise PortUnavailable(_describe(host, port, flag, exc)) from None
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held


def check_tcp(host: str, port: int, flag: str = "--port") -> None:
    """Raise PortUnavailable unless ``host:port`` can be bound now (then released).

    For a port another library binds later (ZMQ sets ``SO_REUSEADDR`` too), so a
    port held by a listener is found at once; one taken in between still fails there.
    """
    for sock in hold_tcp(host, port, flag):
        sock.close()
