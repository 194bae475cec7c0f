"""Videos in the output store, the way users reach it: ``dpserve worker
--output-store``, ``dpserve serve --output-store`` passing a bucket on to its
replicas (a folder: not), and the CRD's ``router.outputStore`` reaching the replica
pods as the flag and the Secret's environment (docs/outputs.md, "Videos")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dpserve.cli import _replica_set, build_parser
from dpserve.config.worker import WorkerConfig
from dpserve.operator import builders as b
from dpserve.operator.spec import DiffusionServiceSpec
from dpserve.sources.uri import S3Source

WORKER = ["worker", "--model", "/m", "--port", "5555"]


def test_the_worker_flag_reaches_its_config_and_back() -> None:
    config = WorkerConfig.from_args(
        build_parser().parse_args([*WORKER, "--output-store", "s3://outs/fleet"])
    )
    assert config.output_store == S3Source("outs", "fleet/")
    assert "--output-store" in config.to_args()
    again = WorkerConfig.from_args(build_parser().parse_args(["worker", *config.to_args()]))
    assert again.output_store == config.output_store
    plain = WorkerConfig.from_args(build_parser().parse_args(WORKER))
    assert plain.output_store is None and "--output-store" not in plain.to_args()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("/srv/videos", "(a folder: --video-dir)"),
        ("hf://org/name", "(a folder: --video-dir)"),
        ("s3://key:secret@b/p", "credentials do not belong"),
    ],
)
def test_a_worker_store_that_is_no_bucket_is_a_usage_error(
    given: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*WORKER, "--output-store", given])
    assert said in capsys.readouterr().err


def _replica_flags(*extra: str) -> tuple[str, ...]:
    args = build_parser().parse_args(["serve", "--model", "/m", *extra])
    return _replica_set(args, Path("/m")).worker_args


def test_serve_passes_a_bucket_to_its_replicas_and_keeps_a_folder_to_its_router() -> None:
    flags = _replica_flags("--output-store", "s3://outs/fleet")
    assert flags[flags.index("--output-store") + 1] == "s3://outs/fleet/"
    # A folder: the router's images only; videos stay on the replica's disk.
    assert "--output-store" not in _replica_flags("--output-store", "/srv/out")
    assert "--output-store" not in _replica_flags()


def _pod(router: dict[str, Any]) -> tuple[dict[str, Any], str]:
    spec = DiffusionServiceSpec.model_validate({"model": {"path": "/models/m"}, "router": router})
    svc = b.Svc("qwen", "ml", "uid-1", 2, spec)
    pod = b.build_replica_pod(svc, 1, b.Images("w", "r"))
    return pod["spec"]["containers"][0], b.spec_hash(spec)


def test_the_crd_output_store_reaches_the_replica_pods_with_the_routers_secret() -> None:
    store = {"uri": "s3://outs/fleet", "credentials": {"secretName": "s3"}}
    container, hashed = _pod({"outputStore": store})
    args = container["args"]
    assert args[args.index("--output-store") + 1] == "s3://outs/fleet"
    assert container["envFrom"] == [{"secretRef": {"name": "s3"}}]
    # Without credentials the pod's own identity; without a store nothing, and the
    # pod's hash as before (no roll on upgrade), which a store then changes.
    keyless, _ = _pod({"outputStore": {"uri": "s3://outs"}})
    assert "--output-store" in keyless["args"] and "envFrom" not in keyless
    bare, plain_hash = _pod({})
    assert "--output-store" not in bare["args"] and "envFrom" not in bare
    assert hashed != plain_hash
    assert _pod({"videoMaxEstimateSeconds": 60})[1] == plain_hash  # other router fields: no roll
