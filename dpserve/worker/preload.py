"""Imported once, by a CPU gang's fork server only (``gang``): its ranks fork with the
libraries loaded instead of importing them each, the larger part of a rank's start-up.

The server's forked ranks hold its liveness pipe, so it outlives a SIGKILLed supervisor
unless told otherwise: it dies with the supervisor, and the ranks (``PR_SET_PDEATHSIG``
on their parent, this server) with it."""

from dpserve.plumbing.proc import die_with_parent

die_with_parent()

from dpserve.worker.boot import import_libraries  # noqa: E402
from dpserve.worker.rank import rank_main  # noqa: E402,F401  (the ranks' entry, loaded too)

import_libraries(None)
