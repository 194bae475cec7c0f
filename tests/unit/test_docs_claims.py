"""Claims in README.md and docs/ that code can check, checked: the route table is the
app's routes, the fuzz section's operation count is the schema's, the tiny-model
variants are the builder's, and every repository path a page cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpserve.cli import build_parser
from dpserve.router.app import RouterSettings, create_app
from dpserve.router.routes import flat

ROOT = Path(__file__).resolve().parents[2]
ROUTER_MD = (ROOT / "docs" / "router.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
METHOD = re.compile(r"^(?:(GET|POST|DELETE|WS|GET/POST) )?(/\S*)$")


def _app_routes() -> set[tuple[str, str]]:
    app = create_app(RouterSettings(workers=("tcp://127.0.0.1:1",)))
    out = set()
    for route in flat(app.routes):
        path = re.sub(r"\{[^}]*\}", "{}", route.path)  # type: ignore[attr-defined]
        methods = getattr(route, "methods", None)
        if type(route).__name__ == "Mount":  # static files under a folder
            out.add(("GET", path + "/{}"))
        elif methods is None:
            out.add(("WS", path))
        else:
            out |= {(m, path) for m in methods - {"HEAD"}}
    return out


def _documented_routes() -> set[tuple[str, str]]:
    """The API table's first column: `METHOD /path` items, a bare `/path` taking the
    method of the item before it (`GET/POST` is both)."""
    table = ROUTER_MD.split("## API", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    out = set()
    for row in table.splitlines()[2:]:
        method = ""
        for item in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            matched = METHOD.match(item)
            assert matched, f"not a route in docs/router.md's API table: {item!r}"
            method = matched.group(1) or method
            path = re.sub(r"\{[^}]*\}", "{}", matched.group(2))
            out |= {(m, path) for m in method.split("/")}
    return out


def test_the_route_table_lists_every_route_and_only_routes() -> None:
    documented, served = _documented_routes(), _app_routes()
    assert sorted(served - documented) == [], "routes missing from docs/router.md, API"
    assert sorted(documented - served) == [], "docs/router.md, API lists routes not served"


def test_the_fuzz_section_counts_the_schemas_operations() -> None:
    app = create_app(RouterSettings(workers=("tcp://127.0.0.1:1",)))
    operations = sum(len(methods) for methods in app.openapi()["paths"].values())
    (count,) = re.findall(r"every operation of\s+`/openapi.json` \((\d+)\)", ROUTER_MD)
    assert int(count) == operations


def _cli_variants() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    tiny = sub.choices["make-tiny-model"]  # type: ignore[attr-defined]
    return list(next(a for a in tiny._actions if a.dest == "variant").choices)


def test_the_variant_lists_are_the_builders() -> None:
    pytest.importorskip("diffusers")
    from dpserve.worker.tiny_model import FAMILY_VARIANTS, VARIANTS, VIDEO_VARIANTS

    variants = [*VARIANTS, *VIDEO_VARIANTS]
    # The CLI spells them out, to import no torch; other families' after these (their
    # paragraphs in docs/worker.md name them).
    assert _cli_variants() == [*variants, *FAMILY_VARIANTS]
    for page in (ROOT / "README.md", ROOT / "docs" / "worker.md"):
        text = page.read_text().replace("\\|", "|")
        (listed,) = re.findall(r"make-tiny-model DIR \[--variant ([\w|-]+)\]", text)
        assert listed.split("|") == variants, page.name


CITED = re.compile(
    r"(?<![\w/.-])((?:docs|tests|dpserve|bench|examples|charts|images)/[\w./-]*(?:\.\w+|/))"
)


def test_every_cited_path_exists_and_no_page_cites_a_file_kept_outside() -> None:
    missing = [
        f"{page.name}: {path}"
        for page in PAGES
        for path in CITED.findall(page.read_text())
        if not (ROOT / path).exists()
    ]
    assert missing == []
    # The design notes live beside the repository, not in it: a citation of them
    # points at nothing a reader of the repository has.
    outside = "DESIGN" + ".md"
    sources = [*PAGES, *ROOT.joinpath("dpserve").rglob("*.py"), ROOT / "Makefile"]
    citing = [str(f.relative_to(ROOT)) for f in sources if outside in f.read_text()]
    assert citing == []
