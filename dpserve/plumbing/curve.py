"""The wire's authentication: one CURVE key per service, and the driver's gatekeeper.

A service has ONE key pair. Its drivers are CURVE servers with it, and their
gatekeeper (a ZAP handler) admits only clients whose public key is the service's
own: a client must hold the secret key to complete the handshake, so knowing the
public key (or the address) is not enough. Clients (the router, ``dpserve probe``,
``ReplicaClient``) use the same pair as their own keys and as the server's key.
A peer without CURVE, or with another key, never gets a message through: libzmq
drops it during the handshake, before the driver sees a byte.

The key file holds the z85 secret key (40 ASCII characters); the public key is
derived from it. No torch here: the CLI, the router and the operator import it.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq
import zmq.utils.z85

log = logging.getLogger(__name__)

Z85_KEY_CHARS: Final = 40
ZAP_DOMAIN: Final = "dpserve"
_ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
# Log a denied peer the first time, then every this many, so a scanner cannot flood the log.
_LOG_EVERY: Final = 100


class WireKeyError(ValueError):
    """A wire key file that is missing, unreadable or not a z85 CURVE secret key."""


@dataclass(frozen=True)
class WireKey:
    secret: bytes = field(repr=False)  # z85, 40 bytes; never in a log line
    public: bytes  # z85, derived from ``secret``

    @classmethod
    def generate(cls) -> WireKey:
        public, secret = zmq.curve_keypair()
        return cls(secret=secret, public=public)

    @classmethod
    def from_secret(cls, secret: bytes) -> WireKey:
        if len(secret) != Z85_KEY_CHARS:
            raise WireKeyError(
                f"a wire key is {Z85_KEY_CHARS} z85 characters (a CURVE secret key), "
                f"got {len(secret)}"
            )
        try:
            public = zmq.curve_public(secret)
        except (zmq.ZMQError, ValueError) as exc:
            raise WireKeyError(f"not a z85 CURVE secret key: {exc}") from None
        return cls(secret=secret, public=public)

    @classmethod
    def load(cls, path: Path) -> WireKey:
        """The key in ``path`` (its z85 secret key; surrounding whitespace is ignored)."""
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise WireKeyError(f"cannot read wire key file {path}: {exc.strerror}") from None
        try:
            return cls.from_secret(raw.strip())
        except WireKeyError as exc:
            hint = "make one with: python -c 'import zmq; print(zmq.curve_keypair()[1].decode())'"
            raise WireKeyError(f"wire key file {path}: {exc}; {hint}") from None

    def write(self, path: Path) -> None:
        """Write the secret key to ``path``, readable by its owner only (mode 0600)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a file that existed keeps its mode otherwise
            os.write(fd, self.secret + b"\n")
        finally:
            os.close(fd)


def secure_server(sock: zmq.Socket[Any], key: WireKey) -> None:
    """Make ``sock`` a CURVE server of ``key``; set before it binds. Its context needs
    a :class:`Gatekeeper`: without one the handshake fails (the domain is enforced),
    so a gatekeeper that is missing or gone admits nobody."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, key.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, key.public)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket[Any], key: WireKey) -> None:
    """Make ``sock`` a CURVE client holding the service key; set before it connects."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, key.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, key.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, key.secret)


class Gatekeeper:
    """A context's ZAP handler: admits CURVE clients holding the service key, no one else.

    One thread answers the handshakes of every CURVE server socket in the context
    (ZAP binds one fixed inproc address, so one gatekeeper per context). Its owner
    closes it after the sockets it guards.
    """

    def __init__(self, ctx: zmq.Context[Any], key: WireKey) -> None:
        self._admit = zmq.utils.z85.decode(key.public)  # ZAP hands over the binary key
        # A plain shadow of the context: works for zmq.asyncio contexts too.
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(ctx.underlying)
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ZAP_ENDPOINT)
        self.admitted = 0
        self.denied = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpserve-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                self._sock.send_multipart(self._answer(self._sock.recv_multipart()))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials...
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"bad request", b"", b""]
        version, request_id, domain, address, _identity, mechanism, *credentials = frames
        good = (
            domain == ZAP_DOMAIN.encode()
            and mechanism == b"CURVE"
            and credentials[:1] == [self._admit]
        )
        if good:
            self.admitted += 1
            return [version, request_id, b"200", b"OK", b"service", b""]
        self.denied += 1
        if self.denied % _LOG_EVERY == 1:
            log.warning(
                "denied a %s peer from %s: not the service's wire key (%d denied so far)",
                mechanism.decode(errors="replace"),
                address.decode(errors="replace"),
                self.denied,
            )
        return [version, request_id, b"400", b"not the service key", b"", b""]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


def plaintext_warning(who: str, risk: str) -> None:
    """The loud start-up line of a process whose wire has no key."""
    log.warning(
        "WIRE IS NOT AUTHENTICATED: %s runs without a wire key, so %s. "
        "Give --wire-key-file (docs/protocol.md, Wire security).",
        who,
        risk,
    )
