"""Process plumbing shared by the worker supervisor and the embedded mode."""

from __future__ import annotations

import ctypes
import signal
from typing import Final

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# A rank's process name (``ps -o comm``, top, psutil's ``name()``): forked ranks share
# their fork server's command line, so the name is how a rank is told apart.
RANK_PROCESS_PREFIX: Final = "dpserve-rank"


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies.

    Children must never outlive whoever started them, even a SIGKILLed parent.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig))


def name_this_process(name: str) -> None:
    """Set the kernel's name of this process (15 bytes at most; longer is cut)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15])
