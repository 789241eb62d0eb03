"""Evaluation on the validation set: when to run it, and one static-shape eval graph.

The last batch is padded with masked samples (data.PaddedEvalShard), so evaluation compiles one
graph whatever the validation set's size; the totals reach the host once, after the sync.
With --model-ema the EMA weights are evaluated the same way beside the raw ones: the same program
on other weights (device data, not constants), so it reuses the raw model's eval graphs and
compiles none of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
import torch_xla

from neuron_train.graphs import GraphWatch
from neuron_train.training.config import RunConfig
from neuron_train.training.data import ClassDataset, eval_loader, to_device
from neuron_train.training.device import Backend
from neuron_train.training.step import autocast

if TYPE_CHECKING:
    from neuron_train.training.ema import ModelEma


class Evaluator:
    def __init__(self, cfg: RunConfig, val: ClassDataset | None, backend: Backend, model: torch.nn.Module,
                 watch: GraphWatch, *, input_dtype: torch.dtype, extracting: bool, ema: ModelEma | None = None):
        self.cfg, self.val, self.backend, self.model, self.watch = cfg, val, backend, model, watch
        self.ema = ema  # --model-ema or None
        self.input_dtype, self.extracting = input_dtype, extracting

    def should_evaluate(self, step: int, *, epoch_end: bool, last: bool) -> bool:
        """Every --eval-every steps, else at each epoch's end; always after the last step."""
        every = self.cfg.train.eval_every
        return (every and step % every == 0) or (not every and epoch_end) or last

    def evaluate(self) -> dict[str, float]:
        """Accuracy and loss over the whole validation set (all ranks), of the raw weights and of the
        EMA's (eval_ema_accuracy, eval_ema_loss); {} without a validation set."""
        if self.val is None:
            return {}
        torch_xla.sync()  # closes the pending train step (its graph is labelled train)
        self.watch.phase("eval")
        self.model.eval()
        result = self._figures(self.model, "eval")
        if self.ema is not None:
            result.update(self._figures(self.ema.module(), "eval_ema"))  # the module stays in eval mode
        self.model.train()
        self.watch.phase("train")
        return result

    def _figures(self, model: torch.nn.Module, prefix: str) -> dict[str, float]:
        totals = self._totals(model)
        torch_xla.sync()
        correct, count, loss_sum = self.backend.all_sum(totals.cpu().tolist())  # host read, after sync
        return {f"{prefix}_accuracy": correct / max(count, 1), f"{prefix}_loss": loss_sum / max(count, 1)}

    def _totals(self, model: torch.nn.Module) -> torch.Tensor:
        """(correct, count, loss sum) of this rank's shard, traced into one graph."""
        t, b = self.cfg.train, self.backend
        # cast: evaluate() calls this only with a validation set
        loader = to_device(eval_loader(cast(ClassDataset, self.val), self.cfg.data, batch_size=t.batch_size,
                                       world=b.world_size, rank=b.rank), b.device)
        totals = torch.zeros(3).to(b.device)  # uploaded as data: one eval graph
        with torch.no_grad():
            for n, (images, labels, valid) in enumerate(loader, 1):
                with autocast(t.precision):
                    logits = model(images.to(self.input_dtype))
                loss = F.cross_entropy(logits.float(), labels, reduction="none")
                hit = (logits.argmax(-1) == labels).float()
                totals = totals + torch.stack([(hit * valid).sum(), valid.sum(), (loss * valid).sum()])
                if self.extracting and n == 2:
                    # Two batches reach both eval graphs: a batch synced by the loader's next fetch
                    # (this iteration's tensors still live) and the last one, synced by evaluate()
                    # with only the totals live. The results are garbage anyway.
                    break
        return totals
