"""Imported once by a CPU gang's fork server (``gang``): its ranks fork with the
libraries loaded instead of importing them each, the larger part of a rank's start-up."""

from dpserve.worker.boot import import_libraries
from dpserve.worker.rank import rank_main  # noqa: F401  (the ranks' entry, loaded too)

import_libraries(None)
