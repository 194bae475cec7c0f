"""The playground: a page at ``/`` to try the service from a browser (docs/router.md).

Plain HTML, CSS and JavaScript shipped as package data (``static/``), no build step
and nothing from a CDN. The page calls only the public API, with the key the user
types (kept in the tab's sessionStorage); the page itself holds nothing secret, so
its paths (``PATHS``) are open, as routes.py declares them.
"""

from __future__ import annotations

from typing import Final

# Each asset's media type; the files live in static/ beside this module.
ASSETS: Final = {
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
PAGE: Final = "index.html"
ASSET_PREFIX: Final = "/playground/"
PATHS: Final = frozenset({"/", *(ASSET_PREFIX + name for name in ASSETS)})
