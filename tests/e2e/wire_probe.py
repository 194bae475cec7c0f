"""What a pod that is not the router gets from a replica's ZMQ port: run inside a pod
(the router image: Python, pyzmq and dpserve) by the Kubernetes journey.

    python wire_probe.py IP PORT SERVICE_PUBLIC_KEY

Prints ``tcp: open`` or ``tcp: <error>`` (can the pod open the port at all: the
NetworkPolicy's doing), then, when open, ``generate: no reply`` or ``generate: reply``
for a generate frame sent as a CURVE client that knows the service's public key but
holds a key pair of its own (the wire key's doing: the replica's gatekeeper denies it).
"""

from __future__ import annotations

import socket
import sys
import time

import zmq

from dpserve.contract import protocol as p


def tcp_opens(ip: str, port: int, within_s: float) -> str | None:
    """None once a connection opens; the last error if none did within ``within_s``.
    Tried again and again: the policy engine admits a new pod's address a moment after
    the pod starts."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((ip, port), timeout=2).close()
            return None
        except OSError as exc:
            if time.monotonic() > deadline:
                return str(exc)
        time.sleep(0.5)


def main(ip: str, port: int, service_public: bytes) -> None:
    error = tcp_opens(ip, port, within_s=10)
    if error is not None:
        print(f"tcp: {error}", flush=True)
        return
    print("tcp: open", flush=True)
    public, secret = zmq.curve_keypair()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.curve_serverkey = service_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.connect(f"tcp://{ip}:{port}")
    body = {"prompt": "a copycat", "size": "64x64", "num_inference_steps": 1, "seed": 1}
    sock.send_multipart(p.encode(p.GENERATE, "copycat", body), zmq.NOBLOCK)
    print("generate: reply" if sock.poll(10_000) else "generate: no reply", flush=True)
    sock.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].encode())
