"""The one error type of model sources: its message says what is wrong and what to do."""

from __future__ import annotations


class SourceError(Exception):
    """A model source that cannot be fetched as given (a bad URI, a refused file, a
    digest that does not match, a store that cannot be reached)."""


class DigestMismatch(SourceError):
    """A fetched file is not what the source says it holds; it was deleted."""


class RevisionChanged(SourceError):
    """The source is no longer at the revision it was pinned to (a bucket prefix whose
    objects changed since): fetching it would give some nodes other weights."""


# ``dpserve fetch``'s exit codes: a fill Job retries a failure (the next try resumes)
# but not a refusal: a digest that does not match, or a source that cannot be fetched
# as given, fails the same way again until someone changes the source.
EXIT_FAILED = 1
EXIT_REFUSED = 3
