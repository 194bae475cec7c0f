"""Two routers over the same replicas (`dpserve serve --dp-size 2` and a second
`dpserve router` with the service's wire key): control ops sent back to back through
alternating routers all apply, each on top of the other router's, and every replica
ends holding their composition."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpserve.worker.tiny_model import build_tiny_lora
from tests.polling import eventually
from tests.servers import RouterProcess, ServeProcess

pytestmark = pytest.mark.e2e

REQUEST = {"prompt": "a paper boat", "size": "64x64", "num_inference_steps": 2, "seed": 7}


def _image(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def test_back_to_back_ops_through_two_routers_compose(
    tiny_model: Path,
    tiny_lora: Path,
    allow_tmp: tuple[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    other = build_tiny_lora(tmp_path_factory.mktemp("loras") / "other", tiny_model, seed=1)
    with ServeProcess(tiny_model, 2, *allow_tmp) as serve:
        cmd = serve.replica_supervisor(0).cmdline()
        key_file = cmd[cmd.index("--wire-key-file") + 1]
        drivers = [f"tcp://127.0.0.1:{serve.scheduler_port + r}" for r in range(2)]
        with RouterProcess(drivers, "--wire-key-file", key_file) as second:
            # /ready answers once one replica serves; an op sent before the router has
            # taken the other in reaches one replica only (seen in CI).
            eventually(lambda: _serving(second.http) == 2, 30, "second router serves both")
            routers = [serve.http, second.http]
            ops: list[tuple[str, dict[str, Any]]] = [
                ("/v1/set_lora", {"lora_nickname": "a", "lora_path": str(tiny_lora)}),
                ("/v1/set_lora", {"lora_nickname": "b", "lora_path": str(other)}),
                # No paths: both adapters must be known to the router that sends it.
                ("/v1/set_lora", {"lora_nickname": ["a", "b"], "strength": [1.0, 0.5]}),
                ("/v1/merge_lora_weights", {"strength": 1.0}),
                ("/v1/unmerge_lora_weights", {}),
                ("/v1/set_lora", {"lora_nickname": "a", "strength": 0.7}),
            ]
            versions = []
            for i, (route, body) in enumerate(ops):
                done = routers[i % 2].post(route, json=body)
                assert done.status_code == 200, (i, route, done.text)
                state = done.json()["control_state"]
                assert state["replicas_holding"] == 2, state
                versions.append(state["version"])
            assert versions == sorted(versions) and len(set(versions)) == len(ops)
            for http in routers:
                listed = http.get("/v1/list_loras").json()
                assert listed["consistent"] is True, listed
                assert listed["result"]["loaded"] == [
                    {"nickname": "a", "path": str(tiny_lora)},
                    {"nickname": "b", "path": str(other)},
                ]
                assert listed["result"]["active"] == [{"nickname": "a", "strength": 0.7}]
                assert listed["result"]["merged"] is False

            # Both routers come to want the same state (the first by its pings).
            def wanted() -> set[tuple[int, str]] | None:
                infos = [h.get("/server_info").json()["control_state"] for h in routers]
                found = {(i["version"], i["digest"]) for i in infos}
                return found if len(found) == 1 else None

            agreed = eventually(wanted, timeout_s=30, what="both routers wanting one state")
            assert agreed.pop()[0] == versions[-1]
            images = [_image(http.post("/v1/images/generations", json=REQUEST)) for http in routers]
            assert images[0] == images[1]


def _serving(http: httpx.Client) -> int:
    replicas = http.get("/health/replicas").json()["replicas"]
    return sum(r["state"] == "serving" for r in replicas)
