"""What --model names: hf://, s3://, or a local folder (dpserve/sources/uri.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpserve.sources.uri import BadUri, HubSource, LocalSource, S3Source, model_name, parse


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("hf://black-forest-labs/FLUX.1-dev", HubSource("black-forest-labs/FLUX.1-dev", "main")),
        ("hf://Qwen/Qwen-Image@v1.0", HubSource("Qwen/Qwen-Image", "v1.0")),
        ("hf://org/name@refs/pr/3", HubSource("org/name", "refs/pr/3")),
        ("hf://org/name@" + "a" * 40, HubSource("org/name", "a" * 40)),
        ("s3://models/flux-dev", S3Source("models", "flux-dev/")),
        ("s3://models/team/flux-dev/", S3Source("models", "team/flux-dev/")),
        ("s3://models", S3Source("models", "")),
        ("/data/flux", LocalSource(Path("/data/flux"))),
        ("relative/folder", LocalSource(Path("relative/folder"))),
        ("odd:name", LocalSource(Path("odd:name"))),
    ],
)
def test_the_forms(text: str, source: object) -> None:
    assert parse(text) == source


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("hf://flux", "hf://ORG/NAME[@REVISION]"),
        ("hf://a/b/c", "hf://ORG/NAME[@REVISION]"),
        ("hf://org/na me", "hf://ORG/NAME[@REVISION]"),
        ("hf://org/name@", "after '@'"),
        ("hf://org/a--b", "no '--'"),
        ("s3://Models/x", "not a bucket name"),
        ("s3://ab/x", "not a bucket name"),
        ("s3://models/a/../b", "'..'"),
        ("gs://models/x", "unknown scheme 'gs'"),
        ("https://huggingface.co/org/name", "unknown scheme 'https'"),
        ("", "the model is empty"),
    ],
)
def test_bad_uris_say_what_to_fix(text: str, says: str) -> None:
    with pytest.raises(BadUri) as refused:
        parse(text)
    assert says in str(refused.value)


@pytest.mark.parametrize(
    "text", ["s3://AKIAKEY:s3cr3t@models/flux", "hf://user:hf_t0ken@org/name", "s3://k@b/x"]
)
def test_credentials_in_a_uri_are_refused_and_not_repeated(text: str) -> None:
    with pytest.raises(BadUri) as refused:
        parse(text)
    message = str(refused.value)
    assert "credentials do not belong" in message and "AWS_ACCESS_KEY_ID" in message
    assert "s3cr3t" not in message and "hf_t0ken" not in message and "AKIAKEY" not in message


def test_the_served_name_a_uri_gives() -> None:
    assert model_name(parse("hf://Qwen/Qwen-Image@main")) == "Qwen/Qwen-Image"
    assert model_name(parse("s3://models/team/flux-dev")) == "flux-dev"
    assert model_name(parse("s3://models")) == "models"
    assert model_name(parse("/data/flux/")) == "flux"


def test_str_is_canonical_and_parses_back() -> None:
    for text in ("hf://org/name", "s3://models/flux-dev", "s3://models"):
        source = parse(text)
        assert parse(str(source)) == source


@pytest.mark.parametrize("command", ["serve", "worker", "fetch"])
def test_a_bad_model_is_refused_while_parsing_flags(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from dpserve.cli import build_parser

    argv = {"serve": ["serve", "--model"], "worker": ["worker", "--port", "1", "--model"]}
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv.get(command, ["fetch"]), "s3://Bad_Bucket/x"])
    assert "'Bad_Bucket' is not a bucket name" in capsys.readouterr().err


def test_a_folder_stays_a_path_and_a_uri_stays_text() -> None:
    from dpserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "hf://org/name"])
    assert args.model == "hf://org/name"  # a Path would make it hf:/org/name
    args = build_parser().parse_args(["serve", "--model", "/data/flux"])
    assert args.model == Path("/data/flux")
