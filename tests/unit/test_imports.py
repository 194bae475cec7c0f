"""Dependency direction: the router and operator never pull in torch; the worker no FastAPI;
the options every process shares (``dpserve.config``) import none of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after_import(module: str) -> set[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def _modules_of(package: str, loaded: set[str]) -> set[str]:
    return {m for m in loaded if m == package or m.startswith(package + ".")}


def _worker_modules(loaded: set[str]) -> set[str]:
    return _modules_of("dpserve.worker", loaded)


@pytest.mark.parametrize(
    "module",
    [
        "dpserve.contract.protocol",
        "dpserve.contract.layout",
        "dpserve.client",
        "dpserve.cli",
        "dpserve.local",
    ],
)
def test_light_modules_do_not_import_torch(module: str) -> None:
    loaded = _modules_after_import(module)
    assert "torch" not in loaded and "diffusers" not in loaded
    assert _worker_modules(loaded) == set()


@pytest.mark.parametrize("module", ["dpserve.config.worker", "dpserve.config.router"])
def test_the_shared_options_are_stdlib_only(module: str) -> None:
    # The operator, the CLI, the router and the worker import them: they import none of
    # those, only the layout arithmetic (stdlib too).
    loaded = _modules_after_import(module)
    ours = _modules_of("dpserve", loaded) - _modules_of("dpserve.config", loaded)
    # ... and the model URI's syntax, to refuse a bad --model while parsing flags.
    pure = {"dpserve.sources", "dpserve.sources.uri", "dpserve.sources.errors"}
    assert ours <= {"dpserve", "dpserve.contract", "dpserve.contract.layout", *pure}
    assert {m.split(".")[0] for m in loaded} & {
        "torch",
        "diffusers",
        "pydantic",
        "zmq",
        "fastapi",
        "starlette",
        "msgspec",
        "kopf",
        "kubernetes",
    } == set()


CONTRACT = ("protocol", "validation", "model_info", "realtime", "video", "control_state", "cost")
CONTRACT += ("layout", "ids", "fields")
PLUMBING = ("transport", "curve", "ports", "bind", "proc", "untrusted")


@pytest.mark.parametrize(
    "module",
    [f"dpserve.contract.{m}" for m in CONTRACT] + [f"dpserve.plumbing.{m}" for m in PLUMBING],
)
def test_the_contract_and_the_plumbing_belong_to_neither_side(module: str) -> None:
    # Driver, router and operator build on them: they import none of those, nor what only
    # one side has (torch on the worker, FastAPI on the router, kopf on the operator).
    loaded = _modules_after_import(module)
    sides = {"dpserve.worker", "dpserve.router", "dpserve.operator", "dpserve.cli"}
    assert not {m for m in loaded if any(m == s or m.startswith(s + ".") for s in sides)}
    heavy = {"torch", "diffusers", "fastapi", "starlette", "kopf", "kubernetes", "pydantic"}
    assert {m.split(".")[0] for m in loaded} & heavy == set()


@pytest.mark.parametrize(
    "module",
    [
        "dpserve.operator.handlers",
        "dpserve.operator.builders",
        "dpserve.router.app",
        "dpserve.router.kubernetes",
    ],
)
def test_operator_and_router_never_import_the_worker_or_torch(module: str) -> None:
    loaded = _modules_after_import(module)
    assert "torch" not in loaded and "diffusers" not in loaded
    assert _worker_modules(loaded) == set()
    if module.startswith("dpserve.operator"):
        assert _modules_of("dpserve.router", loaded) == set()


def test_worker_does_not_import_fastapi() -> None:
    loaded = _modules_after_import("dpserve.worker.rank, dpserve.worker.executor")
    assert "fastapi" not in loaded and "starlette" not in loaded


def test_worker_supervisor_does_not_import_torch() -> None:
    # The supervisor only watches its ranks; torch lives in the rank processes.
    assert "torch" not in _modules_after_import("dpserve.worker.gang")


# The pool's parts that own a replica's connection (dpserve/router/pool.py); everything
# else sends through pool.membership.
CONNECTION_OWNERS = ("membership.py", "health.py", "control_plane.py")


def test_only_the_pool_parts_touch_a_replica_connection() -> None:
    import ast
    from pathlib import Path

    import dpserve.router

    root = Path(dpserve.router.__file__).parent
    reached = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        if path.name not in CONNECTION_OWNERS
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "conn"
    ]
    assert reached == []


def test_the_driver_parts_need_no_torch_and_the_ranks_need_no_driver() -> None:
    # The driver's threads check requests from their headers and values alone; the
    # executor, on every rank, reaches the driver only through what the gang loop
    # hands it (the scheduler's halt, the output path's emit).
    assert "torch" not in _modules_after_import("dpserve.worker.driver")
    loaded = _modules_after_import("dpserve.worker.executor")
    assert _modules_of("dpserve.worker.driver", loaded) == set()
    assert "zmq" not in loaded


SOURCES = ("uri", "select", "plan", "progress", "digest", "cache", "fetch", "s3", "hub")
PURE_SOURCES = ("uri", "select", "plan", "progress", "errors")


@pytest.mark.parametrize("module", [f"dpserve.sources.{m}" for m in SOURCES])
def test_model_sources_need_neither_torch_nor_fastapi(module: str) -> None:
    # The CLI fetches before any replica starts, and the operator will plan fetches:
    # sources import no side of the house, and the pure parts no store's client.
    loaded = _modules_after_import(module)
    sides = {"dpserve.worker", "dpserve.router", "dpserve.operator", "dpserve.cli"}
    assert not {m for m in loaded if any(m == s or m.startswith(s + ".") for s in sides)}
    heavy = {"torch", "diffusers", "fastapi", "starlette", "kopf", "kubernetes", "pydantic"}
    assert {m.split(".")[0] for m in loaded} & heavy == set()
    if module.rsplit(".", 1)[1] in PURE_SOURCES:
        assert {m.split(".")[0] for m in loaded} & {"boto3", "botocore", "huggingface_hub"} == set()


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, with what they require in turn (the
    environment's markers; a requirement's extras followed, as pip does)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        wanted = [(name, "")] + [(name, e) for e in req.extras]
        for dist, extra_of in wanted:
            if (dist, extra_of) in found:
                continue
            found.add((dist, extra_of))  # type: ignore[arg-type]
            todo += [(Requirement(r), extra_of) for r in metadata.requires(dist) or []]
    return {dist for dist, _ in found}  # type: ignore[misc]


def _imported_by(modules: set[str]) -> set[str]:
    """The top-level packages the source of ``modules`` (ours) imports, at any depth of
    the file (a function's lazy import too)."""
    import ast
    import importlib.util
    from pathlib import Path

    names: set[str] = set()
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("extra,modules", [("router", "dpserve.router.app, dpserve.cli")])
def test_what_the_router_imports_its_image_installs(extra: str, modules: str) -> None:
    """Every third-party package our router code imports comes with its extra's
    requirements (the router image installs only those, images/requirements.py): httpx
    once did not, and the router pod crash-looped while every test here passed."""
    import runpy
    from importlib import metadata
    from pathlib import Path

    from packaging.utils import canonicalize_name

    # The list the image installs, as images/requirements.py writes it for the build.
    made = runpy.run_path("images/requirements.py")
    project = made["tomllib"].loads(Path("pyproject.toml").read_text())["project"]
    installed = _closure(made["requirements"](project, extra))
    owners = metadata.packages_distributions()
    ours = _modules_of("dpserve", _modules_after_import(modules))
    imported = _imported_by(ours) - set(sys.stdlib_module_names) - {"dpserve"}
    # Imported only where the router never goes: the CLI's other commands (the worker's
    # torch, the operator's kopf, the fetcher's hub client).
    elsewhere = {"torch", "diffusers", "kopf", "huggingface_hub", "PIL", "numpy", "av"}
    missing = {
        (top, owners.get(top, ["?"])[0])
        for top in imported - elsewhere
        if not any(canonicalize_name(d) in installed for d in owners.get(top, []))
    }
    assert missing == set()
