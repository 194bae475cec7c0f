"""Ids that name their owner: a realtime session's and a video job's id carry the ZMQ
endpoint of the replica that holds them, so any router (restarted, or another replica of
the router) finds the owner without shared state."""

from __future__ import annotations

import base64
import binascii


def encode_owner(endpoint: str) -> str:
    """The endpoint as unpadded base64url: safe in a URL path and in a dotted id."""
    return base64.urlsafe_b64encode(endpoint.encode()).decode().rstrip("=")


def decode_owner(encoded: str) -> str | None:
    """The endpoint ``encode_owner`` wrote; None for anything else (not a ``tcp://``
    endpoint, not base64url, not text)."""
    try:
        endpoint = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return endpoint if endpoint.startswith("tcp://") else None
