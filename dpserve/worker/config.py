"""What one replica's gang is asked to run, shared by the supervisor and every rank.

``WorkerConfig`` is the one place a worker option is spelled. A field that is a
command-line flag carries its flag, help and parser (``Flag``), and the rest is
derived from it: the argparse of ``dpserve worker`` and ``dpserve serve``
(``add_worker_args``, ``add_gang_args``), the config a parsed command line makes
(``WorkerConfig.from_args``), the ``dpserve worker`` flags that ``serve`` and the
operator pass on (``worker_flags``), and the CRD's defaults that mirror the
worker's (``default``). A gang option is shared by every replica of a set (``serve``
takes it too); the others say where one replica runs (model, port, bind, endpoint
file, replica, first GPU). Stdlib only: the operator and the CLI import it, never torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from dpserve.layout import ParallelConfig

Device = Literal["auto", "cpu", "cuda"]
# protocol.STEP_CACHE_KNOBS's kinds (spelled here: this module is stdlib only).
StepCacheKind = Literal["first_block_cache", "taylorseer"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def compile_size(text: str) -> str:
    """``WxH``, both positive whole numbers."""
    width, sep, height = text.partition("x")
    if not (sep and width.isdigit() and height.isdigit() and int(width) and int(height)):
        raise argparse.ArgumentTypeError(f'must look like "512x512", got {text!r}')
    return f"{int(width)}x{int(height)}"


def port_number(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


@dataclass(frozen=True)
class Flag:
    """How a ``WorkerConfig`` field is spelled on the ``dpserve worker`` command line."""

    help: str
    parse: Callable[[str], Any] = str
    name: str | None = None  # default: --field-name
    choices: tuple[str, ...] | None = None
    gang: bool = True  # shared by every replica of a set; False: where one replica runs
    many: bool = False  # repeatable: the field is a tuple, one flag per item
    switch: bool = False  # a boolean: the bare flag turns it on


def _flag(help: str, parse: Callable[[str], Any] = str, **kw: Any) -> dict[str, Flag]:
    return {"flag": Flag(help, parse, **kw)}


@dataclass(frozen=True)
class WorkerConfig:
    # Where one replica runs (``serve`` and the operator pick these per replica).
    model: Path = field(metadata=_flag("diffusers pipeline folder", Path, gang=False))
    port: int = field(metadata=_flag("ZMQ port the driver binds", port_number, gang=False))
    bind: str = field(
        default="127.0.0.1", metadata=_flag("address the driver binds (0.0.0.0: all)", gang=False)
    )
    # None: the port is fixed (a pod declares it), so a taken one fails the start.
    endpoint_file: Path | None = field(
        default=None,
        metadata=_flag(
            "write the endpoint bound here; a taken --port then settles on a free one",
            Path,
            gang=False,
        ),
    )
    replica: int = field(
        default=0, metadata=_flag("replica index reported in replies", int, gang=False)
    )
    first_gpu: int = field(  # the gang's ranks take GPUs first_gpu, first_gpu + 1, ...
        default=0, metadata=_flag("GPU of rank 0; rank k takes first-gpu + k", int, gang=False)
    )
    # The service's CURVE key (dpserve.wire); None: a plaintext wire, warned at start.
    # Not a gang option: ``serve`` makes its own key and hands each replica the file.
    wire_key_file: Path | None = field(
        default=None,
        metadata=_flag(
            "file holding the service's z85 CURVE secret key: only clients with it are served",
            Path,
            gang=False,
        ),
    )
    # The gang options, shared by every replica of a set.
    # Where control ops may load weights and adapters from (dpserve.worker.paths).
    allow_paths: tuple[Path, ...] = field(
        default=(),
        metadata=_flag(
            "folder update_weights_from_disk and set_lora may load from (repeatable; "
            "the model folder always is)",
            Path,
            name="--allow-path",
            many=True,
        ),
    )
    tp: int = field(default=1, metadata=_flag("tensor-parallel degree", positive))
    sp: int = field(default=1, metadata=_flag("sequence-parallel degree", positive))
    # None: derived from --sp (pure Ulysses), as ParallelConfig does.
    ulysses: int | None = field(default=None, metadata=_flag("Ulysses part of --sp", positive))
    ring: int | None = field(default=None, metadata=_flag("ring part of --sp", positive))
    cfg: int = field(default=1, metadata=_flag("CFG-parallel degree (1 or 2)", positive))
    threads_per_rank: int = field(default=1, metadata=_flag("torch threads per rank", positive))
    device: Device = field(
        default="auto",
        metadata=_flag("auto: cuda when a GPU is visible, else cpu", choices=get_args(Device)),
    )
    dtype: Dtype = field(
        default="auto",
        metadata=_flag("auto: bfloat16 on cuda, float32 on cpu", choices=get_args(Dtype)),
    )
    max_queue: int = field(default=64, metadata=_flag("queued requests per replica", positive))
    # Dynamic batching (docs/worker.md): compatible queued generations share one pipeline
    # call of at most this many images; 1 runs every request on its own.
    max_batch: int = field(
        default=1, metadata=_flag("images one batched pipeline call may hold", positive)
    )
    # How long a batch that already holds two or more requests but is not full waits for
    # more; a request with nothing compatible queued behind it never waits.
    batch_wait_ms: int = field(
        default=10, metadata=_flag("ms a partly filled batch waits for more", non_negative)
    )
    max_side: int = field(default=2048, metadata=_flag("largest width/height", positive))
    max_steps: int = field(default=100, metadata=_flag("most inference steps", positive))
    max_sequence_length: int | None = field(  # None: the pipeline's default
        default=None, metadata=_flag("text tokens per prompt (default: the pipeline's)", positive)
    )
    drain_timeout_s: float = field(
        default=300.0, metadata=_flag("seconds to finish work", float, name="--drain-timeout")
    )
    hang_timeout_s: float = field(  # a stopped or frozen rank: the whole gang goes
        default=10.0,
        metadata=_flag(
            "seconds a rank may miss its heartbeat before the gang is killed",
            seconds,
            name="--hang-timeout",
        ),
    )
    max_sessions: int = field(default=8, metadata=_flag("realtime sessions held", positive))
    max_session_mb: float = field(default=256.0, metadata=_flag("state per session", float))
    session_idle_timeout_s: float = field(  # a session nobody stepped for this long is released
        default=60.0,
        metadata=_flag("seconds before an idle release", float, name="--session-idle-timeout"),
    )
    # Step caching and compile (docs/worker.md): the step cache a request that names
    # none gets, with its knob (None: the kind's default); torch.compile of the
    # denoiser, warmed at these sizes (none: the pipeline's default size).
    step_cache: StepCacheKind | None = field(
        default=None,
        metadata=_flag(
            "step cache for requests that name none (default: none)",
            choices=get_args(StepCacheKind),
        ),
    )
    step_cache_threshold: float | None = field(
        default=None, metadata=_flag("first_block_cache's threshold", float)
    )
    step_cache_interval: int | None = field(
        default=None, metadata=_flag("taylorseer's steps between full computations", int)
    )
    compile: bool = field(default=False, metadata=_flag("torch.compile the denoiser", switch=True))
    compile_sizes: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "WxH the warm-up compiles (repeatable; default: the pipeline's default size)",
            compile_size,
            name="--compile-size",
            many=True,
        ),
    )
    # Video jobs (docs/video.md): the longest video a job may ask for, and where a
    # replica keeps finished ones (its disk), for how long, within how many bytes.
    max_frames: int = field(default=129, metadata=_flag("most frames a video job makes", positive))
    video_dir: Path | None = field(  # None: a temporary folder, removed when the worker exits
        default=None,
        metadata=_flag("folder finished videos are kept in (default: a temporary one)", Path),
    )
    video_ttl_s: float = field(
        default=3600.0,
        metadata=_flag("seconds a finished video stays retrievable", seconds, name="--video-ttl"),
    )
    video_max_bytes: int = field(
        default=2 << 30,
        metadata=_flag("bytes of finished videos kept; the oldest go first", positive),
    )
    # Tuning that is no flag.
    warmup_steps: int = 2
    tick_s: float = 2.0  # idle heartbeat through the gang, also keeps collectives from timing out
    stall_s: float = 120.0  # no progress for this long while busy: pings report "stalled"
    collective_timeout_s: float = 600.0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        """The config a ``dpserve worker`` command line (``add_worker_args``) gives."""
        return cls(**{f.name: getattr(args, f.name) for f, _ in _flags()})

    def to_args(self) -> list[str]:
        """Every flag of this config, so ``from_args`` of them parses it back (the
        fields that are no flag keep their defaults there)."""
        return worker_flags({f.name: getattr(self, f.name) for f, _ in _flags()})

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


def _flags(gang_only: bool = False) -> Iterator[tuple[dataclasses.Field[Any], Flag]]:
    """The fields that are flags, in declaration order (the order of --help and of flags)."""
    for f in dataclasses.fields(WorkerConfig):
        flag = f.metadata.get("flag")
        if flag is not None and (flag.gang or not gang_only):
            yield f, flag


def _name(f: dataclasses.Field[Any], flag: Flag) -> str:
    return flag.name or "--" + f.name.replace("_", "-")


def _add(parser: argparse.ArgumentParser, gang_only: bool) -> None:
    for f, flag in _flags(gang_only):
        name = _name(f, flag)
        if flag.switch:
            parser.add_argument(name, dest=f.name, action="store_true", help=flag.help)
            continue
        kw: dict[str, Any] = {"dest": f.name, "type": flag.parse, "help": flag.help}
        if flag.choices is not None:
            kw["choices"] = flag.choices
        else:
            kw["metavar"] = name.removeprefix("--").replace("-", "_").upper()
        if flag.many:
            kw["action"] = _Append
        if f.default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = f.default
        parser.add_argument(name, **kw)


class _Append(argparse.Action):
    """``action="append"`` onto a tuple default (argparse's own needs a list)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``dpserve worker``: where the replica runs, then the gang options."""
    _add(parser, gang_only=False)


def add_gang_args(parser: argparse.ArgumentParser) -> None:
    """The gang options, which ``serve`` takes and passes on to each of its replicas."""
    _add(parser, gang_only=True)


def gang_options(args: argparse.Namespace) -> dict[str, Any]:
    """The gang options of a parsed command line (``add_gang_args``), by field name."""
    return {f.name: getattr(args, f.name) for f, _ in _flags(gang_only=True)}


def worker_flags(options: Mapping[str, object]) -> list[str]:
    """``dpserve worker`` flags for some options, keyed by ``WorkerConfig`` field name.

    Flags come in field order; an option that is None is left out (the worker's
    default applies: for ``ulysses``/``ring`` derived from ``sp``, for
    ``max_sequence_length`` the pipeline's), and so is a switch that is off. A name
    that is no flag is an error.
    """
    unknown = set(options) - {f.name for f, _ in _flags()}
    if unknown:
        raise ValueError(f"not dpserve worker flags: {sorted(unknown)}")
    out: list[str] = []
    for f, flag in _flags():
        value = options.get(f.name)
        if value is None:
            continue
        if flag.switch:  # on: the bare flag; off: nothing
            out += [_name(f, flag)] if value else []
            continue
        items = value if flag.many and isinstance(value, tuple | list) else [value]
        for item in items:  # a repeatable flag: once per item (none for an empty tuple)
            out += [_name(f, flag), str(item)]
    return out


def default(name: str) -> Any:
    """A ``WorkerConfig`` field's default, for settings elsewhere that mirror it."""
    f = WorkerConfig.__dataclass_fields__[name]
    if f.default is dataclasses.MISSING:
        raise ValueError(f"WorkerConfig.{name} has no default")
    return f.default


def gpu_problem(device: str, gang_size: int, visible: int) -> str | None:
    """Why this gang cannot have one GPU per rank, or None.

    NCCL takes one GPU per rank of a communicator: two ranks of a gang on one GPU
    fail deep inside its first collective, so this is said before any rank starts.
    """
    if device == "cpu" or (device == "auto" and visible == 0):
        return None
    if visible == 0:
        return "--device cuda, but no CUDA device is visible"
    if gang_size > visible:
        return (
            f"a gang of {gang_size} ranks needs {gang_size} GPUs (one per rank) but "
            f"{visible} are visible: give it more (CUDA_VISIBLE_DEVICES) or fewer ranks"
        )
    return None


def gang_first_gpu(requested: int, gang_size: int, visible: int) -> int:
    """The GPU of rank 0: ``requested`` when the gang fits from there; else blocks of
    ``gang_size`` GPUs wrap around, so replicas beyond the GPUs share them (which
    works) while the ranks of one gang never do. Needs ``gang_size <= visible``."""
    if requested + gang_size <= visible:
        return requested
    return (requested // gang_size) % (visible // gang_size) * gang_size
