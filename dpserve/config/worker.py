"""What one replica's gang is asked to run, shared by the supervisor and every rank.

``WorkerConfig`` is the one place a worker option is spelled. A field that is a
command-line flag carries its flag, help and parser (``dpserve.config.flags.Flag``),
and the rest is derived from it: the argparse of ``dpserve worker`` and ``dpserve
serve`` (``add_worker_args``, ``add_gang_args``), the config a parsed command line
makes (``WorkerConfig.from_args``), the ``dpserve worker`` flags that ``serve`` and
the operator pass on (``worker_flags``), and the CRD's defaults that mirror the
worker's (``default``). A gang option is shared by every replica of a set (``serve``
takes it too); the others say where one replica runs (model, port, bind, endpoint
file, replica, first GPU). Stdlib only: the operator and the CLI import it, never torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from dpserve.config import flags
from dpserve.config.flags import flag, non_negative, port_number, positive, seconds
from dpserve.contract.layout import ParallelConfig
from dpserve.sources.uri import S3Source

Device = Literal["auto", "cpu", "cuda"]
# protocol.STEP_CACHE_KNOBS's kinds (spelled here: this module is stdlib only).
StepCacheKind = Literal["first_block_cache", "taylorseer"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


def output_bucket(text: str) -> S3Source:
    """``--output-store``: a bucket prefix only (a replica's folder is --video-dir)."""
    from dpserve.sources.uri import BadUri, parse

    try:
        found = parse(text)
    except BadUri as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not isinstance(found, S3Source):
        raise argparse.ArgumentTypeError(
            f"{text}: a worker's output store is s3://BUCKET/PREFIX (a folder: --video-dir)"
        )
    return found


def compile_size(text: str) -> str:
    """``WxH``, both positive whole numbers."""
    width, sep, height = text.partition("x")
    if not (sep and width.isdigit() and height.isdigit() and int(width) and int(height)):
        raise argparse.ArgumentTypeError(f'must look like "512x512", got {text!r}')
    return f"{int(width)}x{int(height)}"


@dataclass(frozen=True)
class WorkerConfig:
    # Where one replica runs (``serve`` and the operator pick these per replica).
    # A URI is fetched into the model cache first (dpserve.sources); the config then
    # holds the local folder it was fetched to.
    model: Path = field(
        metadata=flag(
            "diffusers pipeline folder, or hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX "
            "to fetch into --model-cache first (docs/models.md)",
            flags.model_source,
            serve=False,
        )
    )
    port: int = field(metadata=flag("ZMQ port the driver binds", port_number, serve=False))
    bind: str = field(
        default="127.0.0.1", metadata=flag("address the driver binds (0.0.0.0: all)", serve=False)
    )
    # None: the port is fixed (a pod declares it), so a taken one fails the start.
    endpoint_file: Path | None = field(
        default=None,
        metadata=flag(
            "write the endpoint bound here; a taken --port then settles on a free one",
            Path,
            serve=False,
        ),
    )
    replica: int = field(
        default=0, metadata=flag("replica index reported in replies", int, serve=False)
    )
    first_gpu: int = field(  # the gang's ranks take GPUs first_gpu, first_gpu + 1, ...
        default=0, metadata=flag("GPU of rank 0; rank k takes first-gpu + k", int, serve=False)
    )
    # The service's CURVE key (dpserve.plumbing.curve); None: a plaintext wire, warned at start.
    # Not a gang option: ``serve`` makes its own key and hands each replica the file.
    wire_key_file: Path | None = field(
        default=None,
        metadata=flag(
            "file holding the service's z85 CURVE secret key: only clients with it are served",
            Path,
            serve=False,
        ),
    )
    # The gang options, shared by every replica of a set.
    # Where hf:// and s3:// models are fetched to (dpserve.sources.cache); None: the default.
    model_cache: Path | None = field(
        default=None,
        metadata=flag(
            "folder fetched models are cached in (default: ~/.cache/dpserve/model-cache, "
            "under $DPSERVE_CACHE when set)",
            Path,
        ),
    )
    # Where control ops may load weights and adapters from (dpserve.worker.paths).
    allow_paths: tuple[Path, ...] = field(
        default=(),
        metadata=flag(
            "folder update_weights_from_disk and set_lora may load from (repeatable; "
            "the model folder always is)",
            Path,
            name="--allow-path",
            many=True,
        ),
    )
    tp: int = field(default=1, metadata=flag("tensor-parallel degree", positive))
    sp: int = field(default=1, metadata=flag("sequence-parallel degree", positive))
    # None: derived from --sp (pure Ulysses), as ParallelConfig does.
    ulysses: int | None = field(default=None, metadata=flag("Ulysses part of --sp", positive))
    ring: int | None = field(default=None, metadata=flag("ring part of --sp", positive))
    cfg: int = field(default=1, metadata=flag("CFG-parallel degree (1 or 2)", positive))
    threads_per_rank: int = field(default=1, metadata=flag("torch threads per rank", positive))
    device: Device = field(
        default="auto",
        metadata=flag("auto: cuda when a GPU is visible, else cpu", choices=get_args(Device)),
    )
    dtype: Dtype = field(
        default="auto",
        metadata=flag("auto: bfloat16 on cuda, float32 on cpu", choices=get_args(Dtype)),
    )
    max_queue: int = field(default=64, metadata=flag("queued requests per replica", positive))
    # Dynamic batching (docs/worker.md): compatible queued generations share one pipeline
    # call of at most this many images; 1 runs every request on its own.
    max_batch: int = field(
        default=1, metadata=flag("images one batched pipeline call may hold", positive)
    )
    # How long a batch that already holds two or more requests but is not full waits for
    # more; a request with nothing compatible queued behind it never waits.
    batch_wait_ms: int = field(
        default=10, metadata=flag("ms a partly filled batch waits for more", non_negative)
    )
    max_side: int = field(default=2048, metadata=flag("largest width/height", positive))
    max_steps: int = field(default=100, metadata=flag("most inference steps", positive))
    max_sequence_length: int | None = field(  # None: the pipeline's default
        default=None, metadata=flag("text tokens per prompt (default: the pipeline's)", positive)
    )
    drain_timeout_s: float = field(
        default=300.0, metadata=flag("seconds to finish work", float, name="--drain-timeout")
    )
    hang_timeout_s: float = field(  # a stopped or frozen rank: the whole gang goes
        default=10.0,
        metadata=flag(
            "seconds a rank may miss its heartbeat before the gang is killed",
            seconds,
            name="--hang-timeout",
        ),
    )
    max_sessions: int = field(default=8, metadata=flag("realtime sessions held", positive))
    max_session_mb: float = field(default=256.0, metadata=flag("state per session", float))
    session_idle_timeout_s: float = field(  # a session nobody stepped for this long is released
        default=60.0,
        metadata=flag("seconds before an idle release", float, name="--session-idle-timeout"),
    )
    # Step caching and compile (docs/worker.md): the step cache a request that names
    # none gets, with its knob (None: the kind's default); torch.compile of the
    # denoiser, warmed at these sizes (none: the pipeline's default size).
    step_cache: StepCacheKind | None = field(
        default=None,
        metadata=flag(
            "step cache for requests that name none (default: none)",
            choices=get_args(StepCacheKind),
        ),
    )
    step_cache_threshold: float | None = field(
        default=None, metadata=flag("first_block_cache's threshold", float)
    )
    step_cache_interval: int | None = field(
        default=None, metadata=flag("taylorseer's steps between full computations", int)
    )
    compile: bool = field(default=False, metadata=flag("torch.compile the denoiser", switch=True))
    compile_sizes: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "WxH the warm-up compiles (repeatable; default: the pipeline's default size)",
            compile_size,
            name="--compile-size",
            many=True,
        ),
    )
    # Video jobs (docs/video.md): the longest video a job may ask for, and where a
    # replica keeps finished ones (its disk), for how long, within how many bytes.
    max_frames: int = field(default=129, metadata=flag("most frames a video job makes", positive))
    video_dir: Path | None = field(  # None: a temporary folder, removed when the worker exits
        default=None,
        metadata=flag("folder finished videos are kept in (default: a temporary one)", Path),
    )
    video_ttl_s: float = field(
        default=3600.0,
        metadata=flag("seconds a finished video stays retrievable", seconds, name="--video-ttl"),
    )
    video_max_bytes: int = field(
        default=2 << 30,
        metadata=flag("bytes of finished videos kept; the oldest go first", positive),
    )
    # A bucket finished videos go to instead of the disk, so they outlive the replica
    # (docs/outputs.md). Not a gang flag of ``serve``: its own --output-store (the
    # router's) reaches its replicas when it names a bucket.
    output_store: S3Source | None = field(
        default=None,
        metadata=flag(
            "s3://BUCKET/PREFIX finished videos and thumbnails are uploaded to (AWS_* "
            "variables configure the client; default: kept in --video-dir)",
            output_bucket,
            serve=False,
        ),
    )
    # Per-request LoRA adapters (docs/lora.md): the bytes of adapters one replica keeps
    # loaded for requests (the service's own, set_lora's, are not counted).
    lora_cache_mb: int = field(
        default=1024,
        metadata=flag("MiB of LoRA adapters requests named a replica keeps loaded", positive),
    )
    # Tuning that is no flag.
    warmup_steps: int = 2
    tick_s: float = 2.0  # idle heartbeat through the gang, also keeps collectives from timing out
    stall_s: float = 120.0  # no progress for this long while busy: pings report "stalled"
    collective_timeout_s: float = 600.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """The config a ``dpserve worker`` command line (``add_worker_args``) gives,
        once its ``--model`` is a folder (a URI is fetched first: dpserve.sources)."""
        values = flags.from_args(cls, args, serve_only=False)
        if not isinstance(values["model"], Path):
            raise ValueError(f"{values['model']} is not fetched yet: fetch it to a folder first")
        return cls(**values)

    def to_args(self) -> list[str]:
        """Every flag of this config, so ``from_args`` of them parses it back (the
        fields that are no flag keep their defaults there)."""
        return worker_flags(
            {f.name: getattr(self, f.name) for f, _ in flags.flag_fields(WorkerConfig)}
        )

    @property
    def parallel(self) -> ParallelConfig:
        """The gang's own layout: one replica, whose ranks are 0..G-1."""
        return ParallelConfig(
            tp=self.tp, sp=self.sp, ulysses=self.ulysses or 1, ring=self.ring or 1, cfg=self.cfg
        )

    @property
    def gang_size(self) -> int:
        return self.parallel.gang_size

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.bind}:{self.port}"


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``dpserve worker``: where the replica runs, then the gang options."""
    flags.add_flags(parser, WorkerConfig, serve_only=False)


def add_gang_args(parser: argparse.ArgumentParser) -> None:
    """The gang options, which ``serve`` takes and passes on to each of its replicas."""
    flags.add_flags(parser, WorkerConfig, serve_only=True)


def gang_options(args: argparse.Namespace) -> dict[str, Any]:
    """The gang options of a parsed command line (``add_gang_args``), by field name."""
    return flags.from_args(WorkerConfig, args, serve_only=True)


def worker_flags(options: Mapping[str, object]) -> list[str]:
    """``dpserve worker`` flags for some options, keyed by ``WorkerConfig`` field name.

    An option that is None is left out: the worker's default applies (for
    ``ulysses``/``ring`` derived from ``sp``, for ``max_sequence_length`` the
    pipeline's); see ``flags.to_flags``.
    """
    return flags.to_flags(WorkerConfig, "dpserve worker", options)


def default(name: str) -> Any:
    """A ``WorkerConfig`` field's default, for settings elsewhere that mirror it."""
    return flags.default_of(WorkerConfig, name)
