"""The ``dpserve`` command line; each subcommand imports only what it needs."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dpserve.config.flags import add_flag, model_source, port_number, positive
from dpserve.config.router import RouterConfig, add_router_args
from dpserve.config.worker import WorkerConfig, add_gang_args, add_worker_args
from dpserve.contract.layout import LayoutError
from dpserve.plumbing.bind import PortUnavailable, check_tcp, hold_tcp
from dpserve.plumbing.curve import WireKeyError
from dpserve.sources.errors import SourceError

if TYPE_CHECKING:
    from dpserve.local import ReplicaSetConfig
    from dpserve.plumbing.curve import WireKey
    from dpserve.router.app import RouterSettings


def _add_worker(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = sub.add_parser("worker", help="run one replica: a gang of ranks behind a ZMQ endpoint")
    add_worker_args(w)


def _add_router(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("router", help="HTTP front over replicas (OpenAI images API)")
    add_router_args(r)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("serve", help="embedded default: N local replicas and a router")
    s.add_argument(
        "--model",
        type=model_source,
        default=None,
        help="diffusers pipeline folder, hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX, "
        "fetched once for every replica (default: the tiny model, cached)",
    )
    s.add_argument("--dp-size", type=positive, default=1, help="number of replicas")
    s.add_argument(
        "--scheduler-port", type=port_number, default=5575, help="replica r binds this + r"
    )
    s.add_argument(
        "--wire-key-file",
        type=Path,
        default=None,
        help="wire key for the replicas and the router (default: a new one made at start)",
    )
    add_gang_args(s)
    add_router_args(s, serve=True)


def _add_k8s(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    o = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    scope = o.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", help="watch only these namespaces")
    scope.add_argument("--all-namespaces", action="store_true", help="watch the whole cluster")
    o.add_argument("--liveness-port", type=port_number, default=8080, help="serves /healthz")
    sub.add_parser("crd", help="print the DiffusionService CRD (generated from the code)")
    probe = sub.add_parser("probe", help="ping a local replica's driver (pod probes)")
    probe.add_argument("--port", type=port_number, required=True, help="the driver's port")
    probe.add_argument("--host", default="127.0.0.1", help="the driver's address")
    probe.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the ping")
    probe.add_argument("--wire-key-file", type=Path, default=None, help="the replica's wire key")
    probe.add_argument(
        "--live", action="store_true", help="liveness: answering and not stalled is enough"
    )


def _add_fetch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    f = sub.add_parser(
        "fetch",
        help="fetch a model (hf://, s3://) into the model cache, verified; print its folder",
    )
    f.add_argument(
        "model", type=model_source, help="hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX"
    )
    add_flag(f, WorkerConfig, "model_cache")
    f.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan as JSON (revision, files, sizes, digests, total) and fetch nothing",
    )
    f.add_argument(
        "--json-lines",
        action="store_true",
        help="stdout carries JSON only, one object per line: progress, then the result",
    )
    f.add_argument(
        "--result-file",
        type=Path,
        default=None,
        help="also write the result (folder, revision, bytes; or the error) here as JSON",
    )
    f.add_argument(
        "--pin",
        action="store_true",
        help="resolve the revision and say where its entry will lie under --model-cache "
        "(the result: revision, folder, bytes, the URI naming that revision); fetch nothing",
    )
    f.add_argument(
        "--expect-revision",
        default=None,
        metavar="REVISION",
        help="the revision the source was pinned to: refuse (exit 3) one now at another",
    )
    f.add_argument(
        "--prune-keep",
        type=_count,
        default=None,
        metavar="N",
        help="once fetched, remove this source's other entries but the N newest "
        "(never one being filled)",
    )


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or more")
    return value


def _add_prune(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    f = sub.add_parser(
        "prune-cache",
        help="remove model cache entries: all but the --protect folders and the --keep newest",
    )
    add_flag(f, WorkerConfig, "model_cache")
    f.add_argument(
        "--keep",
        type=_count,
        default=1,
        help="entries kept besides the protected, the newest (default 1: one to roll back to)",
    )
    f.add_argument(
        "--protect",
        type=Path,
        action="append",
        default=[],
        help="a pipeline folder in use (repeat); its entry is never removed",
    )


def _add_tiny(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser(
        "make-tiny-model",
        help="build a tiny Flux-style pipeline, or with --variant video (video-i2v) a "
        "Wan-style text-to-video (image-to-video) one (random weights)",
    )
    t.add_argument("dir", type=Path, help="folder to write the pipeline to (absent or empty)")
    # The builder's VARIANTS and VIDEO_VARIANTS, spelled out: importing them here would
    # load torch for every command.
    variants = (
        *("tiny", "tiny4", "small", "large", "video", "video-small", "video-i2v", "wan-moe"),
        *("flux2", "flux2-small", "sd3", "sd3-small", "qwen-image", "qwen-image-small"),
        *("qwen-image-large", "qwen-image-edit", "qwen-image-edit-plus"),
    )
    t.add_argument(
        "--variant", choices=variants, default="tiny", help="docs/worker.md, Tiny models"
    )
    t.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    lora = sub.add_parser("make-tiny-lora", help="build a random LoRA for a tiny model")
    lora.add_argument("dir", type=Path, help="folder to write the LoRA to")
    lora.add_argument("--model", type=Path, required=True, help="the tiny model it fits")
    lora.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    lora.add_argument("--rank", type=positive, default=4, help="the LoRA's rank")


class _ShowDefaults(argparse.HelpFormatter):
    """``--help`` says each option's default, where it has one worth saying (not None,
    an empty list or an off switch) and its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        unsaid = default in (None, False, (), []) or default is argparse.SUPPRESS
        if unsaid or "default" in text or action.option_strings == []:
            return text
        return text + " (default: %(default)s)"


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dpserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dpserve {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_worker(sub)
    _add_router(sub)
    _add_serve(sub)
    _add_k8s(sub)
    _add_fetch(sub)
    _add_prune(sub)
    _add_tiny(sub)
    for command in sub.choices.values():
        command.formatter_class = _ShowDefaults
    return parser


def _router_settings(args: argparse.Namespace, workers: Sequence[str]) -> RouterSettings:
    """The router of a parsed ``router`` or ``serve`` command line, over ``workers``."""
    from dpserve.router.app import RouterSettings

    config = RouterConfig.from_args(args, serve=args.command == "serve")
    wire_key = _wire_key(args.wire_key_file)
    try:
        settings = RouterSettings.from_config(config, wire_key)
        settings.check()
    except ValueError as exc:
        print(f"dpserve {args.command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return dataclasses.replace(settings, workers=tuple(workers))


def _wire_key(path: Path | None) -> WireKey | None:
    from dpserve.plumbing.curve import WireKey

    return None if path is None else WireKey.load(path)


def _router(args: argparse.Namespace) -> int:
    config = RouterConfig.from_args(args)
    kubernetes = config.discovery == "kubernetes"
    if kubernetes and not (config.namespace and config.service):
        print("dpserve router: kubernetes discovery needs --namespace and --service")
        return 2
    if not (kubernetes or config.worker):
        print("dpserve router: give --worker tcp://HOST:PORT (or --discovery kubernetes)")
        return 2
    # The port first, before FastAPI and the app are imported: a taken one fails at once.
    sockets = hold_tcp(config.host, config.port)
    import uvicorn

    from dpserve.router.app import KubernetesDiscovery, create_app, server_config

    settings = _router_settings(args, config.worker)
    if kubernetes and config.namespace and config.service:  # (checked above)
        k8s = KubernetesDiscovery(config.namespace, config.service, config.control_state_configmap)
        settings = dataclasses.replace(settings, kubernetes=k8s)
    app = create_app(settings)
    uvicorn.Server(server_config(app, config.host, config.port, settings)).run(sockets=sockets)
    return 0


def _local_model(args: argparse.Namespace) -> Path:
    """``--model`` as a local folder: a URI fetched into ``--model-cache`` first (once
    per cache: a concurrent fetch of the same model waits for this one, or this for it)."""
    if isinstance(args.model, Path):
        return args.model  # a folder, used as it is
    from dpserve.sources.fetch import local_folder

    return local_folder(args.model, args.model_cache, bar=sys.stderr.isatty())


def _replica_set(args: argparse.Namespace, model: Path | None) -> ReplicaSetConfig:
    """``serve``'s replicas, each given its gang options; None: the tiny model."""
    from dpserve.config.worker import gang_options, worker_flags
    from dpserve.contract.layout import ParallelConfig
    from dpserve.local import ReplicaSetConfig, default_model
    from dpserve.sources.uri import S3Source

    layout = ParallelConfig(  # fail fast, before a model is built or a replica starts
        tp=args.tp,
        sp=args.sp,
        ulysses=args.ulysses or 1,
        ring=args.ring or 1,
        cfg=args.cfg,
        dp=args.dp_size,
    )
    flags = tuple(worker_flags(gang_options(args)))
    store = getattr(args, "output_store", None)
    if isinstance(store, S3Source):  # a bucket: replicas upload their videos there too
        flags += tuple(worker_flags({"output_store": store}))
    model = model or default_model()
    return ReplicaSetConfig(
        model, args.dp_size, args.scheduler_port, flags, layout.gang_size, args.wire_key_file
    )


def _serve(args: argparse.Namespace) -> int:
    # The HTTP port first: a taken one fails in a second, not after every replica loaded.
    # (The drivers' ports need no check: a taken one settles on a free one.)
    sockets = hold_tcp(args.host, args.port)
    try:
        from dpserve.local import serve

        # Fetched here, once, before any replica starts: N replicas load one copy.
        model = None if args.model is None else _local_model(args)
        replicas = _replica_set(args, model)
        settings = _serve_settings(args, args.model or replicas.model)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return serve(replicas, sockets, args.host, args.port, settings)


def _serve_settings(args: argparse.Namespace, model: Path | str) -> RouterSettings:
    """``serve``'s router; it names the model from the start (its folder's name, or the
    name a URI gives, unless given), so the name holds whatever the replicas load later."""
    from dpserve.sources.uri import model_name, parse

    settings = _router_settings(args, [])
    if settings.served_model_name is not None:
        return settings
    return dataclasses.replace(settings, served_model_name=model_name(parse(str(model))))


def _operator(args: argparse.Namespace) -> int:
    import kopf

    import dpserve.operator.handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        memo=kopf.Memo(namespaces=args.namespace or []),
        standalone=True,  # one replica (Recreate): no peering objects needed
        clusterwide=args.all_namespaces or not args.namespace,
        namespaces=args.namespace or [],
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
    )
    return 0


def _probe(args: argparse.Namespace) -> int:
    """Exit 0 when the driver answers within the deadline and says it can serve.

    Readiness wants status "ok"; liveness (--live) accepts "draining" too, but not
    "stalled" (a hung gang keeps its port open, so only a real ping tells).
    """
    from dpserve.client import ReplicaClient, ReplicaTimeout
    from dpserve.contract.layout import replica_endpoint

    try:
        endpoint = replica_endpoint(args.host, args.port, 0)
        with ReplicaClient(endpoint, key=_wire_key(args.wire_key_file)) as client:
            ping = client.ping(timeout_s=args.timeout)
    except ReplicaTimeout as exc:
        # A driver under a wire key answers nothing to a probe without it, and vice versa.
        print(f"probe: {exc} (is --wire-key-file the driver's key?)", file=sys.stderr)
        return 1
    good = {"ok", "draining"} if args.live else {"ok"}
    if ping.status not in good:
        print(f"probe: replica {ping.replica} is {ping.status}", file=sys.stderr)
        return 1
    return 0


def _worker(args: argparse.Namespace) -> int:
    from dpserve.worker.gang import run_gang

    _wire_key(args.wire_key_file)  # a bad key file fails here, before a fetch or a rank
    if args.endpoint_file is None:  # a fixed port (a pod's): taken, it fails now, not after load
        check_tcp(args.bind, args.port)
    args.model = _local_model(args)  # under the cache's lock: one fill per cache
    config = WorkerConfig.from_args(args)
    if not (config.model / "model_index.json").is_file():
        print(f"dpserve worker: {config.model} is not a diffusers pipeline folder", file=sys.stderr)
        return 2
    return run_gang(config)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from dpserve.worker.quiet import quiet_torchvision_fallback

    quiet_torchvision_fallback()  # make-tiny-model and serve's first start import diffusers
    try:
        if args.command == "worker":
            return _worker(args)
        if args.command == "fetch":
            from dpserve.sources.fetch import FetchOptions, fetch_main

            opts = FetchOptions(
                dry_run=args.dry_run,
                json_lines=args.json_lines,
                result_file=args.result_file,
                pin=args.pin,
                expect_revision=args.expect_revision,
                prune_keep=args.prune_keep,
            )
            return fetch_main(str(args.model), args.model_cache, opts)
        if args.command == "prune-cache":
            from dpserve.sources.fetch import prune_cache

            for removed in prune_cache(args.model_cache, args.keep, args.protect):
                print(f"removed {removed}", flush=True)
            return 0
        if args.command == "make-tiny-model":
            from dpserve.worker.tiny_model import build_tiny_pipeline

            print(build_tiny_pipeline(args.dir, variant=args.variant, seed=args.seed))
            return 0
        if args.command == "make-tiny-lora":
            from dpserve.worker.tiny_model import build_tiny_lora

            print(build_tiny_lora(args.dir, args.model, seed=args.seed, rank=args.rank))
            return 0
        if args.command == "router":
            return _router(args)
        if args.command == "operator":
            return _operator(args)
        if args.command == "crd":
            from dpserve.operator.crd import crd_yaml

            sys.stdout.write(crd_yaml())
            return 0
        if args.command == "probe":
            return _probe(args)
        return _serve(args)
    except (LayoutError, WireKeyError, PortUnavailable, SourceError) as exc:
        print(f"dpserve {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
