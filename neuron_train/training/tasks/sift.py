"""Loss-based online data sifting: back-propagate only the samples the model still gets wrong.

As in SageMaker smart sifting and composer's selective backprop: a forward pass without gradients
scores every sample of the batch by its loss, and only a selection of them goes through the
training forward and backward pass. Made XLA-safe:

- the selected sub-batch always has the same size k (a Python int fixed at start-up), so the step
  is one static graph; samples are picked with `topk` + `index_select`, never a boolean mask;
- the relative-probabilistic rule of smart sifting (keep a sample with probability
  percentile(loss) ** beta) keeps a random number of samples; here it becomes a fixed-size draw:
  k = round(B / (1 + beta)), its expected value, sampled without replacement in proportion to
  those probabilities (Gumbel top-k, all on the device);
- the loss history behind the percentiles is a fixed-length window kept on the device;
- nothing is read back to the host: the kept count is known in Python, and the step the task
  runs at comes from the loop's position, not from a device value.

The selection functions are pure; `SiftingTask` is the thin hook that wraps any task exposing
`per_sample(images, labels)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from neuron_train.common.errors import UsageError
from neuron_train.common.neuron_env import extracting_graphs
from neuron_train.training.config import SiftConfig
from neuron_train.training.tasks.base import PerSampleTask, batch_mean

_EPS = 1e-6  # keeps every keep-probability > 0, so a draw of k always finds k candidates


# ----- pure selection functions ---------------------------------------------------------------
def topk_select(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores (losses): a static-shape selection."""
    # int32: torch_xla 2.9 on the CPU device aborts ("Check failed: buffer != nullptr") when
    # topk's int64 indices feed index_select directly; the cast avoids it (measured).
    return torch.topk(scores, k, sorted=False).indices.int()


def push_history(history: torch.Tensor, filled: torch.Tensor,
                 losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append `losses` to a fixed-length history (oldest dropped); `filled` counts valid entries.

    The newest values sit at the end, so the valid ones are always the last `filled` entries.
    """
    n = history.shape[0]
    history = torch.cat([history, losses.detach().float()])[-n:]
    filled = torch.clamp(filled + losses.shape[0], max=n)
    return history, filled


def percentiles(scores: torch.Tensor, history: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """For each score, the fraction of valid history entries below it (ties count half)."""
    n = history.shape[0]
    valid = (torch.arange(n, device=history.device) >= n - filled).float()       # [N]
    below = (history[None, :] < scores[:, None]).float()                         # [B, N]
    ties = (history[None, :] == scores[:, None]).float()
    return ((below + 0.5 * ties) * valid).sum(1) / filled.clamp(min=1).float()


def keep_probabilities(pct: torch.Tensor, beta: float) -> torch.Tensor:
    """Smart sifting's rule: a sample at loss percentile p is kept with probability p ** beta."""
    return pct.clamp(min=0.0, max=1.0) ** beta


def weighted_draw(probs: torch.Tensor, k: int) -> torch.Tensor:
    """k distinct indices drawn without replacement in proportion to `probs` (Gumbel top-k).

    Equivalent to torch.multinomial(probs, k, replacement=False), built from ops every XLA
    backend lowers: uniform noise, log and topk.
    """
    u = torch.rand(probs.shape, device=probs.device).clamp(min=1e-12, max=1 - 1e-7)
    gumbel = -torch.log(-torch.log(u))
    return topk_select(torch.log(probs + _EPS) + gumbel, k)


def relative_kept(batch_size: int, beta: float) -> int:
    """Fixed sub-batch size of the relative rule: its expected kept count at steady state.

    With percentiles uniform on [0, 1], E[p ** beta] = 1 / (1 + beta): beta 1 keeps half of the
    data, beta 2 a third (the table in SageMaker's smart sifting reference).
    """
    return round(batch_size / (1.0 + beta))


def kept_per_batch(cfg: SiftConfig, batch_size: int) -> int:
    """How many samples of a batch of `batch_size` reach the backward pass once sifting runs."""
    if cfg.sift == "topk":
        k = round(batch_size * cfg.sift_keep)
        rule = f"--sift-keep {cfg.sift_keep}"
    else:
        k = relative_kept(batch_size, cfg.sift_beta)
        rule = f"--sift-beta {cfg.sift_beta} (keeps 1/(1+beta) of a batch)"
    if not 1 <= k <= batch_size:
        raise UsageError(f"{rule} keeps {k} of a batch of {batch_size}: need at least one sample")
    return k


# ----- the hook --------------------------------------------------------------------------------
@dataclass
class LossHistory:
    """Device-side state of the relative rule; its tensors are outputs of every step's graph."""

    history: torch.Tensor
    filled: torch.Tensor

    @classmethod
    def empty(cls, length: int, device: torch.device) -> LossHistory:
        # Made on the host and uploaded as device data. `filled` has shape [1], not []: torch_xla
        # turns a 0-d zero into a constant, which costs a graph of its own (measured).
        return cls(torch.zeros(length).to(device), torch.zeros(1, dtype=torch.long).to(device))

    def push(self, losses: torch.Tensor) -> None:
        self.history, self.filled = push_history(self.history, self.filled, losses)


class SiftingTask:
    """Wraps a task: score the batch without gradients, train on the k most useful samples.

    `step()` returns the optimizer step being trained (the loop's position), so the delay survives
    a resume. During the first `delay` steps the inner task trains on full batches (one graph);
    the switch compiles exactly one more graph, the sifted step, which then repeats. `mark_phase`
    labels that switch for the graph watch (a new phase: its graph is expected, not a recompile).
    """

    SWITCH_PHASE = "train (sifted)"

    def __init__(self, inner: PerSampleTask, cfg: SiftConfig, batch_size: int, grad_accum: int,
                 step: Callable[[], int], mark_phase: Callable[[str], None], device: torch.device):
        self.inner, self.cfg, self.step, self.mark_phase = inner, cfg, step, mark_phase
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.k = kept_per_batch(cfg, batch_size)
        # Graph extraction (neuron_parallel_compile) runs only a few steps: reach the sifted graph
        # within them. Two full steps already give every full-batch graph (first, steady).
        self.delay = min(cfg.sift_delay, 2) if extracting_graphs() else cfg.sift_delay
        self.losses = LossHistory.empty(cfg.sift_history, device) if cfg.sift == "relative" else None

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        if self.losses is None:
            return topk_select(scores, self.k)
        self.losses.push(scores)
        pct = percentiles(scores, self.losses.history, self.losses.filled)
        return weighted_draw(keep_probabilities(pct, self.cfg.sift_beta), self.k)

    @torch.compiler.disable
    def sifting_now(self) -> bool:
        """Whether this step sifts; marks the switch. Host-side and kept out of torch.compile
        (--step-compiler dynamo): traced, the step number would become a guard, one graph per step."""
        step = self.step()
        if step == self.delay > 0:
            self.mark_phase(self.SWITCH_PHASE)
        return step >= self.delay

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.sifting_now():
            per_sample = self.inner.per_sample(images, labels)
            if self.losses is not None:
                self.losses.push(per_sample["loss"])  # warm the history up for free
            return batch_mean(per_sample)
        with torch.no_grad():  # the scoring pass: a forward only, no activations kept
            scores = self.inner.per_sample(images, labels)["loss"]
        idx = self.select(scores)
        return self.inner(images.index_select(0, idx), labels.index_select(0, idx))

    def info(self) -> dict:
        """Samples seen and back-propagated by this rank: known on the host, no device read."""
        steps = self.step()
        full = min(steps, self.delay)
        seen = steps * self.grad_accum * self.batch_size
        backprop = self.grad_accum * (full * self.batch_size + (steps - full) * self.k)
        return {**self.inner.info(), "sift": self.cfg.sift, "sift_kept_per_batch": self.k,
                "samples_scored_per_rank": seen, "samples_backpropagated_per_rank": backprop,
                "backprop_fraction": backprop / seen if seen else None}

    def state_tensors(self) -> list[torch.Tensor]:
        own = [self.losses.history, self.losses.filled] if self.losses is not None else []
        return [*self.inner.state_tensors(), *own]
