"""Text encoders on the output rank only; the other ranks of a gang get their outputs.

Every rank of a gang runs the same pipeline call, so every rank would encode the
same prompts with its own copy of the text encoders (for Flux, T5-XXL: 9.5 GB in
bf16 per rank). Instead only the output rank loads them. A forward hook there
sends each encoder call's output over the gang's CPU group, and on the other
ranks a ``RelayedEncoder`` stands in the encoder's place and returns what
arrived. The pipeline calls its encoders in the same order on every rank (same
prompts, same control flow), so the n-th call meets the n-th output. Tensors
travel as safetensors bytes: the other ranks see the very same embeddings, and
CFG-only gangs stay byte-identical to one rank. Only what the pipeline reads of an
output travels (``encoder_reads.py``); the rest arrives as empty tensors.

The VAE stays on every rank: it is small, and an image-to-image request encodes
its starting image on every rank.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from dpserve.worker.parallel.encoder_reads import Reads, reads_of

Broadcast = Callable[[bytes | None], bytes]  # the output rank's bytes on every rank


def encoder_names(model_index: dict[str, Any]) -> list[str]:
    """The pipeline's text encoders, by component name (``text_encoder``, ``…_2``)."""
    return [
        name
        for name, entry in model_index.items()
        if name.startswith("text_encoder") and isinstance(entry, list) and entry[0] is not None
    ]


# A decoder-style text encoder's KV cache (``cache`` in transformers 5's newer
# outputs, Qwen2.5-VL's): no pipeline reads it after encoding. Nor the vision tower's
# own outputs (Qwen2.5-VL given pixels, as Qwen-Image-Edit's prompts are): the image
# features already sit in the hidden states the pipelines read.
_NOT_RELAYED = frozenset({"past_key_values", "cache", "image_outputs", "video_outputs"})
_TENSORS, _FAILED = b"T", b"E"  # the first byte of every relayed message


def _own(tensor: torch.Tensor) -> torch.Tensor:
    # Outputs may be views of one another (a pooled token of the hidden states),
    # which safetensors refuses to write: each gets its own copy on the host.
    return tensor.detach().to("cpu", copy=True).contiguous()


def _unread(tensor: torch.Tensor) -> torch.Tensor:
    # In an unread entry's place: its dtype, no elements (encoder_reads.py).
    return torch.empty(0, dtype=tensor.dtype)


def _pack(output: Any, reads: Reads | None = None) -> bytes:
    """An encoder's output (a ``ModelOutput``, a tuple or a tensor) as bytes; with
    ``reads``, only the fields and hidden states the pipeline reads carry values."""
    if isinstance(output, torch.Tensor):
        kind, fields = "tensor", {"0": output}
    elif isinstance(output, tuple) and not hasattr(output, "keys"):
        kind, fields = "tuple", {str(i): v for i, v in enumerate(output)}
    else:
        cls = type(output)
        kind, fields = f"{cls.__module__}:{cls.__qualname__}", dict(output.items())
    tensors: dict[str, torch.Tensor] = {}
    layout: list[list[Any]] = []  # [field, number of tensors or -1 for one tensor]
    for name, value in fields.items():
        if name in _NOT_RELAYED:
            continue
        read = reads is None or name in reads.fields
        if isinstance(value, torch.Tensor):
            tensors[name] = _own(value) if read else _unread(value)
            layout.append([name, -1])
        elif isinstance(value, tuple | list) and all(isinstance(v, torch.Tensor) for v in value):
            layers = reads if name == "hidden_states" else None
            for i, v in enumerate(value):
                kept = read and (layers is None or layers.keeps_layer(i, len(value)))
                tensors[f"{name}.{i}"] = _own(v) if kept else _unread(v)
            layout.append([name, len(value)])
        else:
            raise TypeError(f"cannot relay an encoder output field {name!r} of {type(value)}")
    return save_tensors(tensors, metadata={"kind": kind, "layout": json.dumps(layout)})


def _unpack(message: bytes, device: torch.device) -> Any:
    tag, data = message[:1], message[1:]
    if tag == _FAILED:
        raise RuntimeError(f"the output rank's text encoder failed: {data.decode()}")
    tensors = {k: v.to(device) for k, v in load_tensors(data).items()}
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    fields: dict[str, Any] = {}
    for name, count in json.loads(header["layout"]):
        fields[name] = (
            tensors[name] if count == -1 else tuple(tensors[f"{name}.{i}"] for i in range(count))
        )
    kind = header["kind"]
    if kind == "tensor":
        return fields["0"]
    if kind == "tuple":
        return tuple(fields[str(i)] for i in range(len(fields)))
    module, _, qualname = kind.partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    return cls(**fields)


class RelayedEncoder(torch.nn.Module):
    """Stands in for a text encoder held by the output rank: returns its outputs."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device, receive: Broadcast):
        super().__init__()
        self.name = name
        self._receive = receive
        # Pipelines read an encoder's dtype and device; an empty buffer carries both
        # (and follows the module through .to()).
        self.register_buffer("marker", torch.empty(0, dtype=dtype, device=device))

    def _marker(self) -> torch.Tensor:
        return self.get_buffer("marker")

    @property
    def dtype(self) -> torch.dtype:
        return self._marker().dtype

    @property
    def device(self) -> torch.device:
        return self._marker().device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _unpack(self._receive(None), self.device)


def relayed(module: object) -> bool:
    """Whether a pipeline component is a stand-in (its weights live on the output rank)."""
    return isinstance(module, RelayedEncoder)


class EncoderRelay:
    """Installs the hooks (output rank) or the stand-ins (other ranks) on a pipeline."""

    def __init__(self, names: list[str], output_rank: bool, broadcast: Broadcast) -> None:
        self.names = names
        self.output_rank = output_rank
        self.broadcast = broadcast
        self.reads: dict[str, Reads] = {}  # what the pipeline reads of each (install)

    def skipped(self) -> dict[str, None]:
        """``from_pretrained`` overrides: the encoders a non-output rank never loads."""
        return {} if self.output_rank else dict.fromkeys(self.names)

    def install(self, pipe: Any, dtype: torch.dtype, device: torch.device) -> None:
        self.reads = reads_of(pipe)
        for name in self.names:
            if self.output_rank:
                self.attach(getattr(pipe, name), name)
            else:
                pipe.register_modules(**{name: RelayedEncoder(name, dtype, device, self.broadcast)})

    def attach(self, encoder: torch.nn.Module, name: str) -> None:
        """Send every output of ``encoder`` (a newly loaded one too), the pipeline's
        component ``name``, to the other ranks: what the pipeline reads of it."""
        reads = self.reads.get(name)

        def send(module: Any, args: Any, output: Any) -> Any:
            # The other ranks wait for this message: they get one even if packing
            # fails, so every rank fails the request together instead of hanging.
            try:
                message = _TENSORS + _pack(output, reads)
            except Exception as exc:
                self.broadcast(_FAILED + str(exc).encode())
                raise
            self.broadcast(message)
            return output

        encoder.register_forward_hook(send)
