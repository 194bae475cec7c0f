"""The served model's name: its rule, where it comes from (flags, the model folder, the
replicas), and that the README's examples name what `make serve` serves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpserve.cli import _router_settings, _serve_settings, build_parser
from dpserve.contract import protocol as p
from dpserve.contract.model_info import decode
from dpserve.local import default_model
from dpserve.router.served_model import check_model, check_name, served_name
from tests.stub_replica import model_info

README = Path(__file__).parents[2] / "README.md"


def test_a_name_is_printable_ascii_without_spaces() -> None:
    for good in ("tiny", "black-forest-labs/FLUX.1-dev", "a:b_c.d", "x" * 256):
        assert check_name(good) == good
    for bad in ("", "two words", "tab\there", "é", "x" * 257, "nul\0"):
        with pytest.raises(ValueError, match="printable ASCII"):
            check_name(bad)


def test_the_given_name_wins_then_the_folder_a_replica_reports() -> None:
    infos = [decode({**model_info(), "model_path": "/models/flux-dev/"})]
    assert served_name("mine", infos) == "mine"
    assert served_name(None, infos) == "flux-dev"
    assert served_name(None, []) is None  # not known: requests wait for a replica
    check_model(None, "flux-dev")  # left out
    check_model("flux-dev", "flux-dev")
    check_model("anything", None)  # not known yet: the replica serves its one model
    with pytest.raises(p.RequestError) as other:
        check_model("dall-e-3", "flux-dev")
    assert (other.value.code, other.value.status) == ("model_not_found", 404)
    assert [f.field for f in other.value.fields] == ["model"]
    with pytest.raises(p.RequestError) as not_text:
        check_model(["flux-dev"], "flux-dev")
    assert not_text.value.status == 400


def test_the_flag_is_on_serve_and_router_and_serve_defaults_to_the_folder(
    tmp_path: Path,
) -> None:
    parser = build_parser()
    for command in (["router", "--worker", "tcp://x:1"], ["serve"]):
        args = parser.parse_args([*command, "--served-model-name", "flux-dev"])
        assert _router_settings(args, []).served_model_name == "flux-dev"
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--served-model-name", "two words"])
    plain = parser.parse_args(["serve"])
    assert _serve_settings(plain, tmp_path / "my-model").served_model_name == "my-model"
    named = parser.parse_args(["serve", "--served-model-name", "given"])
    assert _serve_settings(named, tmp_path / "my-model").served_model_name == "given"
    router = parser.parse_args(["router", "--worker", "tcp://x:1"])
    assert _router_settings(router, []).served_model_name is None  # the replicas' folder


def test_the_readme_names_the_model_make_serve_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPSERVE_CACHE", str(tmp_path))
    built = tmp_path / "models" / "tiny-seed0"
    built.mkdir(parents=True)
    (built / "model_index.json").write_text("{}")  # as if built: nothing is built here
    served = _serve_settings(build_parser().parse_args(["serve"]), default_model())
    names = re.findall(r'model="([^"]+)"', README.read_text())
    assert names and set(names) == {served.served_model_name}
