"""Control operations on one replica: weights, LoRA adapters, memory, introspection.

Every op runs on every rank of the gang with the same arguments. A state-changing
op becomes a whole control state (dpserve.contract.control_state) that each rank brings
itself to; the ranks then agree, and if any rank failed every rank returns to the
state it held before, so the ranks of a gang never differ. The executor gathers
the per-rank outcomes and the driver answers once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch

from dpserve.contract.control_state import (
    ControlState,
    StateDoc,
    answer,
    bad,
    names,
    parse_doc,
    reduce,
    refusal,
)
from dpserve.contract.model_info import ModelInfo, RankWeights, ReplicaFacts
from dpserve.contract.protocol import (
    CONFLICT,
    INVALID_REQUEST,
    MUTATING_OPS,
    SYNC_STATE,
    UNAVAILABLE,
    ControlRequest,
    RequestError,
)
from dpserve.worker.converge import Effects, StateApplier
from dpserve.worker.lora import LoraAdapters
from dpserve.worker.parallel import ModelParallel
from dpserve.worker.parallel.encoders import EncoderRelay, relayed
from dpserve.worker.pipeline import DENOISERS, Pipeline
from dpserve.worker.weights import checksum, modules_of, tensor_bytes

log = logging.getLogger(__name__)

Agree = Callable[[bool], bool]  # True on every rank only if every rank passed True


class PeerFailed(RequestError):
    """This rank applied the change, but another rank of the gang could not: undone."""


class GangDiverged(RuntimeError):
    """A rank could not return to the state the others hold: the gang must restart."""


class ControlOps:
    def __init__(
        self,
        pipe: Pipeline,
        model_path: Path,
        device: torch.device,
        info: ReplicaFacts | None,
        parallel: ModelParallel,
        relay: EncoderRelay | None = None,
        allow_paths: tuple[Path, ...] = (),
    ) -> None:
        self.pipe = pipe
        self.parallel = parallel
        self.applier = StateApplier(pipe, model_path, device, parallel, relay, allow_paths)
        # What model_info says besides the pipeline's state (None until the boot has it).
        self.info = info
        self._doc = StateDoc()  # the last document a router sent (its state: state())
        self._local_revision = 0  # for ops sent straight to this replica, not by a router

    @property
    def loras(self) -> LoraAdapters:
        return self.applier.loras

    @property
    def released(self) -> bool:
        return self.applier.offload.released

    def held(self) -> StateDoc:
        """The document this replica reports: the last one sent, with the state it really has."""
        return msgspec.structs.replace(self._doc, state=self.state())

    def state(self) -> ControlState:
        return self.applier.state()

    def require_weights(self) -> None:
        if self.released:
            raise RequestError(
                UNAVAILABLE,
                "weights are released from the device; call resume_memory_occupation first",
            )

    def run(self, request: ControlRequest, agree: Agree) -> dict[str, Any]:
        if request.op in MUTATING_OPS:
            return self._change(request, agree)
        handler: Callable[[Mapping[str, Any], Agree], dict[str, Any]] = getattr(
            self, f"op_{request.op}"
        )
        return handler(request.args, agree)

    # ------------------------------------------------------------ state changes

    def _change(self, request: ControlRequest, agree: Agree) -> dict[str, Any]:
        """Bring the gang to the request's state (or the op's change to ours), all or nothing."""
        doc, target, effects = self._converge(lambda: self._target(request), agree)
        if doc is not None:
            self._doc = doc
        result = {} if request.op == SYNC_STATE else answer(request.op, request.args, target)
        held = self.held().to_builtins()
        return {**result, **effects, "changed": bool(effects["actions"]), "state": held}

    def _target(self, request: ControlRequest) -> tuple[StateDoc | None, ControlState]:
        if request.state is None:
            if request.op == SYNC_STATE:
                raise bad("state", "is required for sync_state")
            self._local_revision += 1  # an op sent straight here, not by a router
            return None, reduce(self.state(), request.op, request.args, -self._local_revision)
        try:
            doc = parse_doc(request.state)
        except ValueError as exc:
            raise bad("state", str(exc)) from None
        refused = refusal(self._doc, doc, request.op)
        if refused is not None:
            raise RequestError(CONFLICT, refused)
        return doc, doc.state

    def _converge(
        self, target_of: Callable[[], tuple[StateDoc | None, ControlState]], agree: Agree
    ) -> tuple[StateDoc | None, ControlState, Effects]:
        """Every rank calls ``agree`` the same number of times, whatever fails where."""
        before = self.state()
        error: RequestError | None = None
        try:
            doc, target = target_of()
            effects = self.applier.apply(target)
        except RequestError as exc:
            error = exc
        except Exception as exc:  # a broken file must not take the gang down
            log.exception("applying the control state failed")
            error = RequestError(INVALID_REQUEST, f"could not apply the change: {exc}")
        if agree(error is None):
            return doc, target, effects
        # Some rank failed: every rank returns to where it was.
        try:
            self.applier.apply(before)
            back = True
        except Exception:
            log.exception("could not return to the previous control state")
            back = False
        if not agree(back):
            raise GangDiverged("a rank could not undo a failed control op; restarting the gang")
        if error is not None:
            raise error
        raise PeerFailed(INVALID_REQUEST, "another rank of this replica failed; nothing changed")

    # ------------------------------------------------------------ introspection

    def op_model_info(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        """This rank's answer: the gang's driver merges every rank's (model_info.gathered)."""
        if self.info is None:
            raise RequestError(UNAVAILABLE, "the replica is still starting")
        rank = self.parallel.info
        modules = modules_of(self.pipe.components)
        weights = RankWeights(
            rank=rank.local_rank,
            tp_rank=rank.tp_rank,
            sp_rank=rank.sp_rank,
            cfg_rank=rank.cfg_rank,
            bytes={name: tensor_bytes(module) for name, module in modules.items()},
        )
        info = ModelInfo(
            **msgspec.structs.asdict(self.info),
            model_path=str(self.applier.source_of("transformer")),
            pipeline_class=type(self.pipe).__name__,
            components=sorted(modules),
            released=self.released,
            loras=sorted(self.loras.loaded),
            rank_weights=[weights],
            ranks=1,
        )
        return msgspec.to_builtins(info)

    def op_get_weights_checksum(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        self.require_weights()
        modules = modules_of(self.pipe.components)
        wanted = names(args.get("modules", sorted(modules)), "modules")
        missing = [m for m in wanted if m not in modules]
        if missing:
            raise bad("modules", f"names unknown modules: {', '.join(missing)}")
        held = [name for name in wanted if not relayed(modules[name])]
        return {
            "checksums": {name: checksum(modules[name]) for name in held},
            "tp_rank": self.parallel.info.tp_rank,
            "sharded": [n for n in DENOISERS if n in modules] if self.parallel.sharded else [],
        }

    def op_list_loras(self, args: Mapping[str, Any], agree: Agree) -> dict[str, Any]:
        return {
            "loaded": [{"nickname": n, "path": p} for n, p in sorted(self.loras.loaded.items())],
            "active": [{"nickname": n, "strength": s} for n, s in self.loras.active.items()],
            "merged": self.loras.merged,
        }
