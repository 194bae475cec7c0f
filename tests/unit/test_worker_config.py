"""One typed source of the worker's options: flags, ``serve``'s and the operator's
arguments and the CRD's defaults cannot drift from ``WorkerConfig``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dpserve.cli import _replica_set, build_parser
from dpserve.config.flags import Flag
from dpserve.config.worker import WorkerConfig, worker_flags
from dpserve.operator import builders as b
from dpserve.operator.spec import DiffusionServiceSpec
from dpserve.sources.uri import S3Source

FIELDS = {f.name: f for f in dataclasses.fields(WorkerConfig)}
FLAGS: dict[str, Flag] = {n: f.metadata["flag"] for n, f in FIELDS.items() if "flag" in f.metadata}
GANG = {n for n, flag in FLAGS.items() if flag.serve}
PER_REPLICA = {"model", "port", "bind", "endpoint_file", "replica", "first_gpu", "wire_key_file"}

# Every flag field set away from its default (and valid together), for the round trip.
ODD = WorkerConfig(
    model=Path("/m/flux"),
    port=6000,
    bind="0.0.0.0",
    endpoint_file=Path("/run/dpserve/endpoint"),
    replica=3,
    first_gpu=4,
    wire_key_file=Path("/etc/dpserve/wire/wire.key"),
    output_store=S3Source("outs", "fleet/"),
    model_cache=Path("/var/cache/dpserve/models"),
    allow_paths=(Path("/loras"), Path("/data/weights")),
    tp=2,
    sp=4,
    ulysses=2,
    ring=2,
    cfg=2,
    threads_per_rank=3,
    device="cpu",
    dtype="bfloat16",
    max_queue=5,
    max_batch=4,
    batch_wait_ms=3,
    max_side=512,
    max_steps=7,
    max_sequence_length=77,
    drain_timeout_s=12.5,
    hang_timeout_s=4.5,
    max_sessions=2,
    max_session_mb=64.5,
    session_idle_timeout_s=9.0,
    # (Both knobs, and compile with sp: the flags parse; the worker's start refuses them.)
    step_cache="taylorseer",
    step_cache_threshold=0.2,
    step_cache_interval=4,
    compile=True,
    compile_sizes=("512x512", "768x512"),
    max_frames=33,
    video_dir=Path("/var/lib/dpserve/videos"),
    video_ttl_s=60.0,
    video_max_bytes=1 << 20,
    lora_cache_mb=64,
)


def _actions(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


def _worker(flags: list[str]) -> WorkerConfig:
    return WorkerConfig.from_args(build_parser().parse_args(["worker", *flags]))


def test_the_flags_are_every_option_but_internal_tuning() -> None:
    # A new field is a flag (with help and parser) or deliberately none of these.
    assert set(FIELDS) - set(FLAGS) == {"warmup_steps", "tick_s", "stall_s", "collective_timeout_s"}
    # --output-store: serve's own (the router's) reaches its replicas when a bucket.
    assert set(FLAGS) - GANG == PER_REPLICA | {"output_store"}


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_every_gang_option_is_a_flag_of_worker_and_serve_with_its_default(command: str) -> None:
    actions = _actions(command)
    for name in GANG:
        action = actions[name]
        assert action.default == FIELDS[name].default, name
        assert action.help == FLAGS[name].help and action.help, name
        assert action.type is (None if FLAGS[name].switch else FLAGS[name].parse), name
    if command == "worker":
        assert set(FLAGS) <= set(actions)
    else:  # serve picks these per replica; its own --model and --port (HTTP) are no gang's,
        # nor its --wire-key-file (the key it hands its replicas and its router).
        assert not (PER_REPLICA - {"model", "port", "wire_key_file"}) & set(actions)


def test_worker_requires_model_and_port_and_defaults_the_rest() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--port", "1"])
    assert _worker(["--model", "/m", "--port", "1"]) == WorkerConfig(model=Path("/m"), port=1)


@pytest.mark.parametrize("config", [ODD, WorkerConfig(model=Path("/m"), port=1)])
def test_flags_parse_back_to_the_same_config(config: WorkerConfig) -> None:
    assert _worker(config.to_args()) == config


def test_the_round_trip_config_sets_every_flag() -> None:
    assert all(getattr(ODD, n) != FIELDS[n].default for n in FLAGS)


def test_none_means_unset_and_unknown_names_are_errors() -> None:
    assert worker_flags({"ulysses": None, "ring": None, "max_sequence_length": None}) == []
    assert worker_flags({"cfg": 2, "tp": 2}) == ["--tp", "2", "--cfg", "2"]  # field order
    with pytest.raises(ValueError, match="tick_s"):
        worker_flags({"tick_s": 1.0})
    with pytest.raises(ValueError, match="drain_timeout"):
        worker_flags({"drain_timeout": 1.0})  # the field is drain_timeout_s


def test_serve_passes_its_gang_options_to_each_replica() -> None:
    args = build_parser().parse_args(
        [
            *("serve", "--dp-size", "2", "--cfg", "2", "--max-sessions", "3"),
            *("--dtype", "float16", "--allow-path", "/loras", "--allow-path", "/w"),
        ]
    )
    replicas = _replica_set(args, Path("/m"))
    for r in range(2):
        flags = ["--model", "/m", "--port", str(5575 + r), *replicas.replica_args(r)]
        assert _worker(flags) == WorkerConfig(
            model=Path("/m"),
            port=5575 + r,
            replica=r,
            first_gpu=2 * r,  # its own block of a gang's two GPUs
            allow_paths=(Path("/loras"), Path("/w")),
            cfg=2,
            max_sessions=3,
            dtype="float16",
        )


def test_serve_with_defaults_runs_default_workers() -> None:
    replicas = _replica_set(build_parser().parse_args(["serve"]), Path("/m"))
    flags = ["--model", "/m", "--port", "1", *replicas.replica_args(0)]
    assert _worker(flags) == WorkerConfig(model=Path("/m"), port=1)


def _operator_config(index: int = 0, **spec: Any) -> WorkerConfig:
    body = {"model": {"path": "/models/qwen"}, **spec}
    svc = b.Svc("qwen", "ml", "uid-1", 1, DiffusionServiceSpec.model_validate(body))
    args = b.worker_args(svc, index)
    assert args[0] == "worker"
    return _worker(args[1:])


def test_a_default_spec_runs_default_workers() -> None:
    # The CRD's defaults are the worker's: only where the pod runs differs (and the
    # pod's address, wire key and model root, which only Kubernetes knows).
    assert _operator_config(2) == WorkerConfig(
        model=Path("/models/qwen"),
        port=5575,
        bind="$(POD_IP)",  # expanded by the kubelet
        replica=2,
        device="cuda",
        wire_key_file=Path("/etc/dpserve/wire/wire.key"),
        allow_paths=(Path("/models"),),
    )


def test_the_operator_passes_the_spec_to_the_worker() -> None:
    config = _operator_config(
        1,
        parallelism={"tp": 2, "sp": 4, "ulysses": 2, "ring": 2, "cfg": 2},
        device="cpu",
        schedulerPort=6001,
        threadsPerRank=4,
        maxSequenceLength=128,
        maxBatch=4,
        batchWaitMs=25,
        router={"requestTimeoutSeconds": 90},
        realtime={"maxSessions": 3, "maxSessionMB": 512, "idleTimeoutSeconds": 30},
    )
    assert config == WorkerConfig(
        model=Path("/models/qwen"),
        port=6001,
        bind="$(POD_IP)",
        replica=1,
        tp=2,
        sp=4,
        ulysses=2,
        ring=2,
        cfg=2,
        threads_per_rank=4,
        device="cpu",
        max_sequence_length=128,
        max_batch=4,
        batch_wait_ms=25,
        drain_timeout_s=90,
        max_sessions=3,
        max_session_mb=512,
        session_idle_timeout_s=30,
        wire_key_file=Path("/etc/dpserve/wire/wire.key"),
        allow_paths=(Path("/models"),),
    )
