"""The router's LoRA options (docs/lora.md): ``--lora NAME=PATH``, ``--adapter-routing``
and ``--adapter-home-slack`` travel from ``dpserve router``/``serve`` and from the CRD's
``spec.router.loras``/``adapterRouting``/``adapterHomeSlack`` to the pool, spelled once
in RouterConfig. What the slack does to routing: tests/unit/test_router_lora.py."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dpserve.cli import _router_settings, build_parser
from dpserve.config.router import LoraName, RouterConfig
from dpserve.contract.validation import LORA_NAME_RE
from dpserve.operator import builders as b
from dpserve.operator.spec import DiffusionServiceSpec, RouterSpec
from dpserve.router.pool import PoolSettings
from dpserve.router.settings import RouterSettings

LORAS = ["--lora", "ink=/loras/ink", "--lora", "wash=s3://bucket/wash"]


def _router(flags: list[str]) -> RouterConfig:
    return RouterConfig.from_args(build_parser().parse_args(["router", *flags]))


def _operator_router(**router: Any) -> RouterConfig:
    spec = DiffusionServiceSpec.model_validate({"model": {"path": "/models/m"}, "router": router})
    args = b.router_args(b.Svc("qwen", "ml", "uid-1", 1, spec))
    return _router(args[1:])


def test_the_flags_reach_the_pool_on_router_and_serve() -> None:
    config = _router(["--worker", "tcp://a:1", *LORAS, "--adapter-routing", "blind"])
    assert config.lora == (LoraName("ink", "/loras/ink"), LoraName("wash", "s3://bucket/wash"))
    pool = RouterSettings.from_config(config, None).pool
    assert pool.loras == {"ink": "/loras/ink", "wash": "s3://bucket/wash"}
    assert pool.adapter_routing == "blind"
    for command in (["router", "--worker", "tcp://x:1"], ["serve"]):
        args = build_parser().parse_args([*command, *LORAS, "--adapter-routing", "blind"])
        settings = _router_settings(args, ())
        assert settings.pool.loras == {"ink": "/loras/ink", "wash": "s3://bucket/wash"}
        assert settings.pool.adapter_routing == "blind"


def test_the_home_slack_reaches_the_pool_from_router_serve_and_the_crd() -> None:
    for command in (["router", "--worker", "tcp://x:1"], ["serve"]):
        args = build_parser().parse_args([*command, "--adapter-home-slack", "0.25"])
        assert _router_settings(args, ()).pool.adapter_home_slack == 0.25
    assert _operator_router(adapterHomeSlack=0).adapter_home_slack == 0.0
    assert _operator_router(adapterHomeSlack=4.5).adapter_home_slack == 4.5
    default = RouterConfig.from_args(build_parser().parse_args(["router", "--worker", "x"]))
    assert default.adapter_home_slack == _operator_router().adapter_home_slack == 1.5
    assert PoolSettings().adapter_home_slack == RouterSpec().adapterHomeSlack == 1.5


@pytest.mark.parametrize("bad", ["-1", "16.5", "nan", "inf", "lots"])
def test_a_home_slack_outside_0_to_16_requests_is_refused(bad: str) -> None:
    with pytest.raises(SystemExit):
        _router(["--worker", "tcp://a:1", "--adapter-home-slack", bad])
    if bad != "lots":
        with pytest.raises(ValidationError):
            RouterSpec(adapterHomeSlack=float(bad))


def test_by_default_routing_is_adapter_aware_and_no_name_is_registered() -> None:
    config = _router(["--worker", "tcp://a:1"])
    assert (config.adapter_routing, config.lora) == ("aware", ())
    assert PoolSettings().adapter_routing == "aware" and PoolSettings().loras == {}
    assert RouterSpec().adapterRouting == "aware" and RouterSpec().loras == {}


@pytest.mark.parametrize("bad", ["ink", "ink=", "=/p", "../x=/p", "a b=/p"])
def test_a_bad_lora_flag_is_a_usage_error(bad: str) -> None:
    with pytest.raises(SystemExit):
        _router(["--worker", "tcp://a:1", "--lora", bad])
    with pytest.raises(SystemExit):
        _router(["--worker", "tcp://a:1", "--adapter-routing", "sometimes"])


def test_the_operator_passes_the_crds_loras_and_adapter_routing() -> None:
    config = _operator_router(
        loras={"wash": "/models/loras/wash", "ink": "/models/loras/ink"}, adapterRouting="blind"
    )
    assert config.loras == {"ink": "/models/loras/ink", "wash": "/models/loras/wash"}
    assert config.adapter_routing == "blind"
    assert _operator_router().lora == ()


def test_the_crd_refuses_names_no_request_could_give() -> None:
    with pytest.raises(ValidationError, match="is no adapter name"):
        RouterSpec(loras={"../up": "/p"})
    with pytest.raises(ValidationError):
        RouterSpec(loras={"ink": ""})
    with pytest.raises(ValidationError):
        RouterSpec(adapterRouting="sometimes")
    assert LORA_NAME_RE.match("style-1.v2")
