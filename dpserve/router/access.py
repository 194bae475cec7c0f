"""Which key each route needs, declared on the route's handler and read back from the app.

A handler is marked where it is defined (``@public``, ``@inference``, ``@admin``), so
a route cannot be added without saying who may call it: ``Levels.of`` refuses an app
with an unmarked route, and the auth middleware and the OpenAPI security read the
one table it builds. A request's level is that of the route the app will pick for
it (the first full match, else the first partial one: a wrong method's 405), so a
path no route serves needs an inference key, and a path's parameter can never lend
it an open route's level.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from starlette.routing import BaseRoute, Match, Route, WebSocketRoute

T = TypeVar("T")


class Access(enum.StrEnum):
    OPEN = "open"  # no key
    INFERENCE = "inference"  # an API key or an admin key
    ADMIN = "admin"  # an admin key


OPEN, INFERENCE, ADMIN = Access.OPEN, Access.INFERENCE, Access.ADMIN

_MARK: Final = "__dpserve_access__"


def declare(level: Access, handler: T) -> T:
    """``handler`` (an endpoint, or a mounted ASGI app), marked as needing ``level``."""
    held = getattr(handler, _MARK, None)
    if held is not None and held != level:
        raise ValueError(f"{handler!r} is declared {held} and {level}")
    setattr(handler, _MARK, level)
    return handler


def public(handler: T) -> T:
    return declare(OPEN, handler)


def inference(handler: T) -> T:
    return declare(INFERENCE, handler)


def admin(handler: T) -> T:
    return declare(ADMIN, handler)


def declared(route: BaseRoute) -> Access | None:
    """The level ``route`` was declared with: its endpoint's, or a mount's app's."""
    handler = getattr(route, "endpoint", None) or getattr(route, "app", None)
    level = getattr(handler, _MARK, None)
    return level if isinstance(level, Access) else None


def _path(route: BaseRoute) -> str:
    return str(getattr(route, "path", route))


@dataclass(frozen=True)
class Levels:
    """Each route's level, in the app's order, and shortcuts for the common paths."""

    routes: tuple[tuple[BaseRoute, Access], ...]
    # A path that only routes of one level can match, whatever the method: one lookup.
    exact: Mapping[str, Access]
    # The paths of routes that match their own path only; any other path can only be
    # matched by the rest of the routes (a parameter's, a mount's), kept in order.
    fixed: frozenset[str]
    patterned: tuple[tuple[BaseRoute, Access], ...]

    @classmethod
    def of(cls, routes: Iterable[BaseRoute]) -> Levels:
        """The table of an app's routes; ValueError names a route declared with no level."""
        leveled = []
        for route in routes:
            level = declared(route)
            if level is None:
                raise ValueError(
                    f"route {_path(route)} declares no access level: mark its handler "
                    "@public, @inference or @admin (dpserve/router/access.py)"
                )
            leveled.append((route, level))
        fixed = {_path(r): lv for r, lv in leveled if _fixed(r)}
        exact = {
            path: level
            for path, level in fixed.items()
            if {lv for r, lv in leveled if _could_match(r, path)} == {level}
        }
        patterned = tuple((r, lv) for r, lv in leveled if not _fixed(r))
        return cls(tuple(leveled), exact, frozenset(fixed), patterned)

    def of_scope(self, scope: Any) -> Access:
        """The level of the route the app will pick for this request; INFERENCE for none."""
        if scope.get("root_path"):  # routing strips it from the path first
            return _picked(self.routes, scope)
        path = scope["path"]
        found = self.exact.get(path)
        if found is not None:
            return found
        return _picked(self.routes if path in self.fixed else self.patterned, scope)

    def of_path(self, path: str, method: str = "GET") -> Access:
        """The level of an HTTP request for ``path``."""
        return self.of_scope({"type": "http", "path": path, "method": method, "root_path": ""})

    def declared(self, level: Access) -> frozenset[str]:
        """The paths of the routes declared at ``level``."""
        return frozenset(_path(route) for route, lv in self.routes if lv == level)


def _picked(routes: Iterable[tuple[BaseRoute, Access]], scope: Any) -> Access:
    """Routing replayed: the first full match's level, else the first partial one's."""
    partial = None
    for route, level in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return level
        if match == Match.PARTIAL and partial is None:
            partial = level
    return partial or INFERENCE


def _fixed(route: BaseRoute) -> bool:
    """A route that matches its own path only (no parameter, not a mount)."""
    return isinstance(route, Route | WebSocketRoute) and "{" not in route.path


def _could_match(route: BaseRoute, path: str) -> bool:
    """Whether ``route`` matches ``path`` for some method or scope type."""
    regex = getattr(route, "path_regex", None)
    return regex is not None and regex.match(path) is not None
