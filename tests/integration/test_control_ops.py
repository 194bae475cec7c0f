"""Every control op against real gangs (CFG, tensor and sequence parallel), failure paths
included: each layout keeps its ranks' state in step, whether they hold the same
tensors (CFG, sp) or pieces of them (tp)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dpserve.client import ReplicaClient
from dpserve.contract.protocol import (
    RequestError,
)
from tests.workers import WorkerProcess

pytestmark = pytest.mark.gang

REQUEST = dict(
    prompt="a blue teapot",
    negative_prompt="noise",
    true_cfg_scale=3.0,
    width=64,
    height=64,
    num_inference_steps=3,
    seed=11,
)


LAYOUTS = {"cfg2": ("--cfg", "2"), "tp2": ("--tp", "2"), "ring2": ("--sp", "2", "--ring", "2")}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def worker(
    request: pytest.FixtureRequest, tiny_model: Path, allow_tmp: tuple[str, str]
) -> Iterator[WorkerProcess]:
    args = (*LAYOUTS[request.param], "--max-sequence-length", "64", *allow_tmp)
    with WorkerProcess(tiny_model, *args) as w:
        yield w


@pytest.fixture
def client(worker: WorkerProcess) -> Iterator[ReplicaClient]:
    with worker.client() as c:
        yield c


def _png(client: ReplicaClient) -> bytes:
    return client.generate(**REQUEST)[1][0]


def _error(client: ReplicaClient, op: str, **args: object) -> RequestError:
    with pytest.raises(RequestError) as err:
        client.control(op, **args)
    return err.value


def test_model_info_and_checksum_agree_across_ranks(
    client: ReplicaClient, tiny_model: Path
) -> None:
    info = client.control("model_info")
    assert info["pipeline_class"] == "FluxPipeline"
    assert info["model_path"] == str(tiny_model)
    assert info["ranks"] == 2 and info["gang_size"] == 2
    sums = client.control("get_weights_checksum")
    assert sums["ranks"] == 2
    sharded = info["parallel"]["tp"] > 1
    assert list(sums["shards"]) == (["transformer"] if sharded else [])
    assert set(sums["checksums"]) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    only = client.control("get_weights_checksum", modules=["vae"])
    assert only["checksums"] == {"vae": sums["checksums"]["vae"]}
    assert _error(client, "get_weights_checksum", modules=["nope"]).fields[0].field == "modules"


def test_update_weights_bad_path_keeps_old_weights(client: ReplicaClient, tmp_path: Path) -> None:
    before_sums = client.control("get_weights_checksum")
    before_png = _png(client)
    for bad in (str(tmp_path / "missing"), str(tmp_path)):
        err = _error(client, "update_weights_from_disk", model_path=bad)
        assert err.code == "invalid_request" and err.fields[0].field == "model_path"
    assert _error(client, "update_weights_from_disk", modules=["transformer"]).fields
    assert client.control("get_weights_checksum") == before_sums
    assert _png(client) == before_png


def test_update_weights_swaps_the_transformer_and_back(
    client: ReplicaClient, tiny_model: Path, tiny_model_b: Path
) -> None:
    original_sums = client.control("get_weights_checksum")["checksums"]
    original_png = _png(client)
    done = client.control("update_weights_from_disk", model_path=str(tiny_model_b))
    # Every denoiser by default; this model has one, and says what it reloaded.
    assert done["modules"] == ["transformer", "transformer_2"]
    assert done["actions"] == ["reloaded transformer"], done
    # A second expert named where there is none is refused, naming it.
    err = _error(client, "update_weights_from_disk", model_path=str(tiny_model_b),
                 modules=["transformer_2"])  # fmt: skip
    assert err.fields[0].field == "modules" and "transformer_2" in str(err)
    swapped = client.control("get_weights_checksum")["checksums"]
    assert swapped["transformer"] != original_sums["transformer"]
    assert swapped["vae"] == original_sums["vae"]
    assert client.control("model_info")["model_path"] == str(tiny_model_b)
    assert _png(client) != original_png
    client.control("update_weights_from_disk", model_path=str(tiny_model))
    assert client.control("get_weights_checksum")["checksums"] == original_sums
    assert _png(client) == original_png


def test_lora_set_merge_unmerge_list(client: ReplicaClient, tiny_lora: Path) -> None:
    base_png = _png(client)
    base_sum = client.control("get_weights_checksum", modules=["transformer"])
    assert client.control("list_loras")["loaded"] == []
    err = _error(client, "set_lora", lora_nickname="style", lora_path="/no/such/lora")
    assert err.fields[0].field == "lora_path"
    assert _error(client, "set_lora", lora_nickname="style").fields[0].field == "lora_path"
    assert _error(client, "merge_lora_weights").code == "invalid_request"

    client.control("set_lora", lora_nickname="style", lora_path=str(tiny_lora), strength=1.0)
    listed = client.control("list_loras")
    assert listed["loaded"] == [{"nickname": "style", "path": str(tiny_lora)}]
    assert listed["active"] == [{"nickname": "style", "strength": 1.0}]
    lora_png = _png(client)
    assert lora_png != base_png

    client.control("merge_lora_weights")
    assert client.control("list_loras")["merged"] is True
    assert _error(client, "set_lora", lora_nickname="style").code == "invalid_request"
    client.control("unmerge_lora_weights")
    assert _error(client, "unmerge_lora_weights").code == "invalid_request"
    assert _png(client) == lora_png

    client.control("set_lora", lora_nickname="style", strength=0.0)
    assert _png(client) == base_png
    assert (
        _error(client, "set_lora", lora_nickname="style", target="vae").fields[0].field == "target"
    )
    # A weight update drops adapters (they belonged to the old modules) and says so.
    model = client.control("model_info")["model_path"]
    done = client.control("update_weights_from_disk", model_path=model)
    assert done["loras_cleared"] == ["style"]
    assert client.control("list_loras")["loaded"] == []
    assert client.control("get_weights_checksum", modules=["transformer"]) == base_sum


def test_release_and_resume_memory(client: ReplicaClient, worker: WorkerProcess) -> None:
    before_png = _png(client)
    before_sums = client.control("get_weights_checksum")
    released = client.control("release_memory_occupation")
    assert released["changed"] is True and released["bytes_moved"] > 1_000_000
    assert client.ping().released is True
    err = _error(client, "get_weights_checksum")
    assert err.code == "unavailable"
    with pytest.raises(RequestError) as gen_err:
        client.generate(**REQUEST)
    assert gen_err.value.code == "unavailable"
    assert "resume_memory_occupation" in str(gen_err.value)
    assert client.control("release_memory_occupation")["changed"] is False
    assert client.control("resume_memory_occupation")["changed"] is True
    assert client.ping().released is False
    assert client.control("get_weights_checksum") == before_sums
    assert _png(client) == before_png
    assert worker.proc.poll() is None


def test_unknown_op_is_refused(client: ReplicaClient) -> None:
    err = _error(client, "reboot")
    assert err.code == "unsupported" and "known ops" in str(err)
