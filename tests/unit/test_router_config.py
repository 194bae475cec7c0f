"""One typed source of the router's options: its flags, ``serve``'s, the settings' and
the CRD's defaults, and the flags the operator passes cannot drift from ``RouterConfig``."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dpserve.cli import build_parser
from dpserve.config.flags import Flag
from dpserve.config.router import RouterConfig, router_flags
from dpserve.operator import builders as b
from dpserve.operator.spec import DiffusionServiceSpec, RouterSpec
from dpserve.router.settings import RouterSettings
from dpserve.router.tenants import tenant_key

FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
FLAGS: dict[str, Flag] = {n: f.metadata["flag"] for n, f in FIELDS.items() if "flag" in f.metadata}
SERVED = {n for n, flag in FLAGS.items() if flag.serve}
ROUTER_ONLY = {"worker", "discovery", "namespace", "service", "control_state_configmap"}


def _actions(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


def _router(flags: list[str]) -> RouterConfig:
    return RouterConfig.from_args(build_parser().parse_args(["router", *flags]))


def test_every_option_is_a_flag_and_serve_takes_all_but_where_the_replicas_are() -> None:
    assert set(FIELDS) == set(FLAGS)
    assert set(FLAGS) - SERVED == ROUTER_ONLY | {"wire_key_file"}


@pytest.mark.parametrize("command", ["router", "serve"])
def test_each_flag_has_the_configs_default_help_and_parser(command: str) -> None:
    actions = _actions(command)
    for name in FLAGS if command == "router" else SERVED:
        action = actions[name]
        assert action.default == FIELDS[name].default, name
        assert action.help == FLAGS[name].help and action.help, name
        assert action.type is FLAGS[name].parse, name
    if command == "serve":  # its replicas are its own; so is its key (it hands it to both)
        assert not ROUTER_ONLY & set(actions)
        assert actions["wire_key_file"].help != FLAGS["wire_key_file"].help


def test_the_settings_defaults_are_the_configs() -> None:
    assert RouterSettings.from_config(RouterConfig(), None) == RouterSettings()


def test_a_command_line_reaches_the_settings() -> None:
    config = _router(
        [
            *("--worker", "tcp://a:1", "--worker", "tcp://b:2", "--host", "0.0.0.0"),
            *("--port", "9000", "--request-timeout", "12.5", "--max-inflight-per-replica", "3"),
            *("--policy", "round_robin", "--max-waiting", "7", "--output-dir", "/out"),
            *("--served-model-name", "m", "--max-connections", "9", "--backlog", "11"),
            *("--output-max-files", "13", "--output-max-age", "14", "--video-poll", "0.5"),
            *("--video-max-estimate", "60", "--max-body", "15", "--max-upload-bytes", "16"),
            *("--body-timeout", "17", "--api-key", "k" * 16, "--admin-key", "a" * 16),
        ]
    )
    settings = RouterSettings.from_config(config, None)
    assert settings.workers == ("tcp://a:1", "tcp://b:2")
    assert settings.public_url == "http://0.0.0.0:9000"  # none given: its own address
    pool = settings.pool
    assert (pool.request_timeout_s, pool.max_inflight, pool.policy, pool.max_queue) == (
        12.5,
        3,
        "round_robin",
        7,
    )
    assert (settings.output_dir, settings.served_model_name) == (Path("/out"), "m")
    assert (settings.max_connections, settings.backlog) == (9, 11)
    assert (settings.output_max_files, settings.output_max_age_s) == (13, 14.0)
    assert (settings.video_poll_s, settings.video_max_estimate_s) == (0.5, 60.0)
    assert (settings.max_body_bytes, settings.max_upload_bytes, settings.body_timeout_s) == (
        15,
        16,
        17.0,
    )
    assert (settings.api_keys, settings.admin_keys) == (("k" * 16,), ("a" * 16,))
    assert "k" * 16 not in repr(config) and "a" * 16 not in repr(settings)


def test_key_files_are_read_while_parsing(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# inference\n" + "b" * 16 + "\n\n" + "c" * 16 + "\n")
    config = _router(["--worker", "tcp://a:1", "--api-key", "a" * 16, "--api-key-file", str(keys)])
    assert [tenant_key(k).key for k in config.api_keys] == ["a" * 16, "b" * 16, "c" * 16]
    assert config.admin_keys == ()


def test_none_means_unset_and_unknown_names_are_errors() -> None:
    assert router_flags({"public_url": None, "api_key_file": ()}) == []
    assert router_flags({"port": 1, "host": "h"}) == ["--host", "h", "--port", "1"]  # field order
    with pytest.raises(ValueError, match="max_queue"):
        router_flags({"max_queue": 1})  # the flag is --max-waiting


def _operator_router(**router: Any) -> RouterConfig:
    spec = DiffusionServiceSpec.model_validate({"model": {"path": "/models/m"}, "router": router})
    args = b.router_args(b.Svc("qwen", "ml", "uid-1", 1, spec))
    assert args[0] == "router"
    return _router(args[1:])


def test_a_default_spec_runs_a_default_router() -> None:
    # Only where it runs differs: the replicas' Service, the pod's address and port, the
    # wire key and the name (the resource's, as the replicas' folder name is unknown).
    assert _operator_router() == RouterConfig(
        discovery="kubernetes",
        namespace="ml",
        service="qwen-replicas",
        control_state_configmap="qwen-control-state",
        wire_key_file=Path("/etc/dpserve/wire/wire.key"),
        host="0.0.0.0",
        port=b.ROUTER_PORT,
        served_model_name="qwen",
        # The router Service's names in the cluster (DNS rebinding: dpserve/router/hosts.py).
        allowed_host=("qwen", "qwen.ml", "qwen.ml.svc", "qwen.ml.svc.cluster.local"),
    )


def test_the_crds_router_defaults_are_the_routers() -> None:
    spec = RouterSpec()
    assert spec.requestTimeoutSeconds == FIELDS["request_timeout"].default
    assert spec.maxInflightPerReplica == FIELDS["max_inflight_per_replica"].default
    assert spec.maxWaiting == FIELDS["max_waiting"].default
    assert spec.policy == FIELDS["policy"].default
    assert spec.videoMaxEstimateSeconds == FIELDS["video_max_estimate"].default
    assert spec.maxConnectionsPerPeer == FIELDS["max_connections_per_peer"].default


def test_the_operator_passes_the_spec_to_the_router() -> None:
    config = _operator_router(
        requestTimeoutSeconds=90,
        maxInflightPerReplica=4,
        maxWaiting=10,
        policy="round_robin",
        servedModelName="Qwen/Qwen-Image",
        videoMaxEstimateSeconds=600,
        maxConnectionsPerPeer=0,
        allowedHosts=["images.example.com", "*"],
    )
    assert (config.request_timeout, config.max_inflight_per_replica, config.max_waiting) == (
        90,
        4,
        10,
    )
    assert (config.policy, config.served_model_name, config.video_max_estimate) == (
        "round_robin",
        "Qwen/Qwen-Image",
        600,
    )
    assert config.max_connections_per_peer == 0
    assert config.allowed_host[-2:] == ("images.example.com", "*")


def test_fair_shares_travel_from_the_command_line_and_the_crd_to_the_pool() -> None:
    from dpserve.config.router import TenantWeight

    config = _router(
        [
            *("--worker", "tcp://a:1", "--max-requests-per-tenant", "5"),
            *("--tenant-weight", "team-a=2", "--tenant-weight", "team-b=30"),
        ]
    )
    assert config.tenant_weight == (TenantWeight("team-a", 2), TenantWeight("team-b", 30))
    pool = RouterSettings.from_config(config, None).pool
    assert (pool.max_per_tenant, pool.tenant_weights) == (5, {"team-a": 2, "team-b": 30})
    assert RouterSettings().pool.max_per_tenant == 0  # no cap unless asked
    assert RouterSpec().maxRequestsPerTenant == FIELDS["max_requests_per_tenant"].default
    passed = _operator_router(maxRequestsPerTenant=7, tenantWeights={"team-b": 3, "team-a": 1})
    assert passed.max_requests_per_tenant == 7
    assert passed.tenant_weights == {"team-a": 1, "team-b": 3}


@pytest.mark.parametrize("bad", ["team-a", "team-a=0", "team-a=1001", "Team=2", "=2", "a=x"])
def test_a_bad_tenant_weight_is_a_usage_error(bad: str) -> None:
    with pytest.raises(SystemExit):
        _router(["--worker", "tcp://a:1", "--tenant-weight", bad])


def test_the_crd_refuses_weights_for_names_no_tenant_can_have() -> None:
    from pydantic import ValidationError

    from dpserve.operator.spec import TENANT_NAME
    from dpserve.router.tenants import _NAME

    assert TENANT_NAME.pattern == _NAME.pattern  # the operator's copy of the router's rule
    with pytest.raises(ValidationError, match="is no tenant name"):
        RouterSpec(tenantWeights={"Team A": 2})
    with pytest.raises(ValidationError):
        RouterSpec(tenantWeights={"team-a": 0})


# ---------------------------------------------------------------- the output store


def test_the_output_store_flags_reach_the_settings_and_the_store() -> None:
    from dpserve.router.app import output_store
    from dpserve.router.bucket import BucketStore
    from dpserve.router.store import OutputStore
    from dpserve.sources.uri import S3Source

    for command in ("router", "serve"):
        args = ["--output-store", "s3://outs/fleet/a", "--output-url-ttl", "120"]
        base = ["--worker", "tcp://a:1"] if command == "router" else ["--model", "/m"]
        config = RouterConfig.from_args(
            build_parser().parse_args([command, *base, *args]), serve=command == "serve"
        )
        settings = RouterSettings.from_config(config, None)
        assert (settings.output_s3, settings.output_dir) == (S3Source("outs", "fleet/a/"), None)
        assert settings.output_url_ttl_s == 120
    store = output_store(settings)
    assert isinstance(store, BucketStore) and store.url_ttl_s == 120
    # A folder, by URI or bare path, is --output-dir's store; its files live no longer
    # than their links.
    for given in ("file:///srv/out", "/srv/out", "srv/out"):
        local = RouterSettings.from_config(
            _router(["--worker", "tcp://a:1", "--output-store", given, "--output-url-ttl", "60"]),
            None,
        )
        assert local.output_dir == Path(given.removeprefix("file://"))
        assert local.output_s3 is None
        folder = output_store(local)
        assert isinstance(folder, OutputStore) and folder.max_age_s == 60
    plain = RouterSettings.from_config(
        _router(["--worker", "tcp://a:1", "--output-dir", "/o"]), None
    )
    assert (plain.output_url_ttl_s, plain.output_max_age_s) == (3600, 3600.0)
    assert output_store(plain) == OutputStore(Path("/o"), plain.public_url, 1000, 3600.0)
    assert output_store(RouterSettings()) is None


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--output-store", "s3://Bad_Bucket/p"], "is not a bucket name"),
        (["--output-store", "hf://org/name"], "not a model hub"),
        (["--output-store", "gs://b/p"], "unknown scheme"),
        (["--output-store", "file://relative"], "file:///ABSOLUTE/PATH"),
        (["--output-store", "s3://key:secret@b/p"], "credentials do not belong"),
        (["--output-url-ttl", "0"], "must be >= 1"),
        (["--output-url-ttl", "604801"], "at most 604800 s"),
    ],
)
def test_a_bad_output_store_is_a_usage_error_that_says_why(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _router(["--worker", "tcp://a:1", *flags])
    assert said in capsys.readouterr().err


def test_output_store_and_output_dir_together_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dpserve.cli import _router_settings

    args = ["router", "--worker", "tcp://a:1", "--output-dir", "/o", "--output-store", "/p"]
    with pytest.raises(SystemExit) as exited:
        _router_settings(build_parser().parse_args(args), ["tcp://a:1"])
    assert exited.value.code == 2
    assert "give --output-store or --output-dir, not both" in capsys.readouterr().err


def test_the_crd_output_store_reaches_the_router_with_its_secret_as_env() -> None:
    from pydantic import ValidationError

    store = {"uri": "s3://outs/fleet", "urlTtlSeconds": 90, "credentials": {"secretName": "s3"}}
    config = _operator_router(outputStore=store)
    assert (str(config.output_store), config.output_url_ttl) == ("s3://outs/fleet/", 90)
    spec = DiffusionServiceSpec.model_validate(
        {"model": {"path": "/models/m"}, "router": {"outputStore": store}}
    )
    deployment = b.build_router_deployment(
        b.Svc("qwen", "ml", "uid-1", 1, spec), b.Images("w", "r")
    )
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": "s3"}}]
    # No store: no flag, no Secret; one without credentials uses the pod's own.
    assert _operator_router().output_store is None
    keyless = _operator_router(outputStore={"uri": "s3://outs"})
    assert keyless.output_url_ttl == FIELDS["output_url_ttl"].default
    bare = b.build_router_deployment(
        b.Svc(
            "qwen",
            "ml",
            "uid-1",
            1,
            DiffusionServiceSpec.model_validate(
                {"model": {"path": "/models/m"}, "router": {"outputStore": {"uri": "s3://outs"}}}
            ),
        ),
        b.Images("w", "r"),
    )
    assert "envFrom" not in bare["spec"]["template"]["spec"]["containers"][0]
    with pytest.raises(ValidationError):
        RouterSpec.model_validate({"outputStore": {"uri": "/srv/out"}})  # pods share no folder
