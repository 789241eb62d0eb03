"""When the training loop saves a checkpoint, what goes in it, and resuming from one.

The file format, atomic writes and safe loading live in checkpoint.py; this is the loop's side:
which step saves, the state gathered from model/optimizer/position, and the collective order
(ZeRO-1 shards on every rank, then rank 0's main file, then a barrier).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch_xla

from neuron_train.common.errors import UsageError
from neuron_train.graphs import GraphWatch
from neuron_train.training import checkpoint as ckpt
from neuron_train.training.config import RunConfig
from neuron_train.training.device import Backend
from neuron_train.training.optim import load_optimizer_state

if TYPE_CHECKING:
    from neuron_train.training.ema import ModelEma


@dataclass
class Position:
    """How far the run has come; saved in checkpoints so a resumed run continues exactly."""

    step: int = 0    # optimizer steps done
    epoch: int = 0   # current epoch
    batch: int = 0   # micro-batches of the current epoch already trained on


class Checkpointer:
    def __init__(self, cfg: RunConfig, backend: Backend, run_dir: Path, watch: GraphWatch, *,
                 writes: bool, extracting: bool):
        self.cfg, self.backend, self.run_dir, self.watch = cfg, backend, run_dir, watch
        self.writes, self.extracting = writes, extracting
        t = cfg.train
        self.global_batch = t.batch_size * t.grad_accum * backend.world_size

    def should_save(self, step: int, *, last: bool, stopping: bool) -> bool:
        """Every --checkpoint-every steps, after the last step, and when a stop signal arrived."""
        every = self.cfg.checkpoint.checkpoint_every
        return bool((every and step % every == 0) or last or stopping)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, pos: Position,
             ema: ModelEma | None = None) -> Path | None:
        """Save at `pos` (all ranks call it); returns the file on rank 0, None elsewhere."""
        torch_xla.sync()  # closes the pending step: the same graph the loader would have cut
        self.watch.phase("checkpoint")  # after the sync: that step's graph still counts as train
        path = None
        zero1 = self.cfg.optim.zero1
        if zero1 and not self.extracting:  # each rank saves its own shard first
            ckpt.save_shard(self.run_dir, pos.step, self.backend.rank, ckpt.to_cpu(optimizer.state_dict()))
            self.backend.barrier()  # all shards on disk before rank 0 commits the checkpoint
        if self.writes:
            state = {"model": ckpt.to_cpu(model.state_dict()),
                     "optimizer": (ckpt.sharded_marker(self.backend.world_size) if zero1
                                   else ckpt.to_cpu(optimizer.state_dict())),
                     "position": asdict(pos), "rng": ckpt.rng_state(),
                     "global_batch": self.global_batch, "config": self.cfg.to_dict()}
            if ema is not None:  # --model-ema: its weights continue on resume
                state["model_ema"] = ema.state_dict()
            path = ckpt.save(self.run_dir, pos.step, state, self.cfg.checkpoint.keep_last)
        self.backend.barrier()
        self.watch.phase("train")
        return path

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               ema: ModelEma | None = None) -> tuple[Position, Path]:
        """Load --resume into model and optimizer; returns the position to continue from."""
        # cast: callers resume only with --resume given (TrainLoop._start checks it is not None)
        path = ckpt.resolve(self.run_dir, cast(str, self.cfg.checkpoint.resume))
        state = ckpt.load_resumable(path)  # checksum and structure checked: one line, never a KeyError
        if state["global_batch"] != self.global_batch:
            raise UsageError(f"{path} was trained with a global batch of {state['global_batch']}, "
                             f"this run has {self.global_batch}: the data position would not match")
        ckpt.load_model_state(model, state, path)  # a mismatch is one line naming the model
        if ema is not None:
            if "model_ema" not in state:
                raise UsageError(f"{path} holds no EMA weights (saved without --model-ema): resume "
                                 "without --model-ema, or start a new run with it")
            ckpt.load_model_state(ema.timm.module, {**state, "model": state["model_ema"]}, path)
        try:
            load_optimizer_state(optimizer, ckpt.optimizer_state(
                path, state, zero1=self.cfg.optim.zero1, world_size=self.backend.world_size,
                rank=self.backend.rank))
        except (ValueError, KeyError, TypeError) as exc:  # torch's own check of the saved groups
            raise UsageError(f"{path}: its optimizer state does not fit this run's optimizer "
                             f"({str(exc)[:120]}): resume with the same --optimizer and model") from None
        torch_xla.sync()  # materialise the loaded weights before the first step
        if ema is not None:
            ema.load_state_dict(state["model_ema"])  # into the flat buffer: a host transfer, no graph
        # After the sync, not before: every sync advances the XLA seed, and the saved seed was read
        # after save()'s sync, so the next sync in either run is the first step's batch fetch.
        ckpt.set_rng_state(state["rng"])
        return Position(**state["position"]), path
