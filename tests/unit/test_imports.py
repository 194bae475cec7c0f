"""Dependency direction: the router and operator never pull in torch; the worker no FastAPI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after_import(module: str) -> set[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


# The one piece of the worker others may import: WorkerConfig, the source of the
# worker's flags and defaults (stdlib only).
WORKER_CONFIG = {"dpserve.worker", "dpserve.worker.config"}


def _worker_modules(loaded: set[str]) -> set[str]:
    return {m for m in loaded if m == "dpserve.worker" or m.startswith("dpserve.worker.")}


@pytest.mark.parametrize(
    "module",
    ["dpserve.protocol", "dpserve.layout", "dpserve.client", "dpserve.cli", "dpserve.local"],
)
def test_light_modules_do_not_import_torch(module: str) -> None:
    loaded = _modules_after_import(module)
    assert "torch" not in loaded and "diffusers" not in loaded
    assert _worker_modules(loaded) <= WORKER_CONFIG


def test_the_model_info_contract_belongs_to_neither_side() -> None:
    # Driver and router both build on dpserve.model_info: it imports neither.
    loaded = _modules_after_import("dpserve.model_info")
    assert not _worker_modules(loaded) and not any(m.startswith("dpserve.router") for m in loaded)
    assert {m.split(".")[0] for m in loaded} & {"torch", "fastapi", "starlette", "zmq"} == set()


def test_worker_config_is_stdlib_only() -> None:
    loaded = _modules_after_import("dpserve.worker.config")
    assert _worker_modules(loaded) == WORKER_CONFIG
    assert {m.split(".")[0] for m in loaded} & {"torch", "diffusers", "pydantic", "zmq"} == set()


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
    allowed = WORKER_CONFIG if module.startswith("dpserve.operator") else set()
    assert _worker_modules(loaded) <= allowed
    if module.startswith("dpserve.operator"):
        assert not any(m.startswith("dpserve.router") for m in loaded)


def test_worker_does_not_import_fastapi() -> None:
    loaded = _modules_after_import("dpserve.worker.rank, dpserve.worker.executor")
    assert "fastapi" not in loaded and "starlette" not in loaded


def test_worker_supervisor_does_not_import_torch() -> None:
    # The supervisor only watches its ranks; torch lives in the rank processes.
    assert "torch" not in _modules_after_import("dpserve.worker.gang")
