"""Process plumbing shared by the worker supervisor and the embedded mode."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies.

    Children must never outlive whoever started them, even a SIGKILLed parent.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig))
