"""The one error type of model sources: its message says what is wrong and what to do."""

from __future__ import annotations


class SourceError(Exception):
    """A model source that cannot be fetched as given (a bad URI, a refused file, a
    digest that does not match, a store that cannot be reached)."""


class DigestMismatch(SourceError):
    """A fetched file is not what the source says it holds; it was deleted."""
