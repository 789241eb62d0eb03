"""training/checkpointer.py in-process: which step saves, what a checkpoint holds, and resuming from it.

The training tests reach the Checkpointer inside training subprocesses, where mutmut cannot see it
(docs/measurements.md, "Scores"); these check its promises as calls on the CPU XLA device: a save holds the
model, optimizer, position, random state, global batch and config, labelled as the checkpoint phase;
a resume puts every one of them back, draws the same random numbers the saved run drew next, and
refuses a run of another global batch or optimizer with one line.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm

from neuron_train.common.errors import UsageError
from neuron_train.training import checkpoint as ckpt
from neuron_train.training.checkpointer import Checkpointer, Position
from neuron_train.training.config import RunConfig
from neuron_train.training.device import Backend


class PhaseLog:
    """A stand-in for GraphWatch: only its contract with the Checkpointer (the phases it is told)."""

    def __init__(self):
        self.phases: list[str] = []

    def phase(self, name: str) -> None:
        self.phases.append(name)


def config(*, batch_size=4, grad_accum=2, every=0, keep_last=3, resume=None, zero1=False) -> RunConfig:
    cfg = RunConfig()
    return replace(cfg, train=replace(cfg.train, batch_size=batch_size, grad_accum=grad_accum),
                   checkpoint=replace(cfg.checkpoint, checkpoint_every=every, keep_last=keep_last, resume=resume),
                   optim=replace(cfg.optim, zero1=zero1))


def backend(world_size=1, rank=0) -> Backend:
    return Backend(kind="CPU", device=torch_xla.device(), world_size=world_size, rank=rank, local_rank=rank,
                   gloo_bridge=False, host_group=None)


def checkpointer(tmp_path, cfg=None, *, writes=True, extracting=False, world_size=1):
    return Checkpointer(cfg or config(), backend(world_size), tmp_path, PhaseLog(), writes=writes,
                        extracting=extracting)


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and an AdamW with state: two steps taken on the XLA device."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2).to(torch_xla.device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.ones(4, 3, device=torch_xla.device())).square().sum().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    return model, opt


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in model.state_dict().items()}


# ----- when -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("every,step,last,stopping,saves", [
    (5, 10, False, False, True), (5, 11, False, False, False), (5, 5, False, False, True),
    (0, 10, False, False, False), (0, 3, True, False, True), (0, 3, False, True, True),
    (5, 7, True, False, True), (5, 7, False, True, True)])
def test_a_checkpoint_is_saved_every_n_steps_at_the_last_step_and_when_stopping(tmp_path, every, step, last,
                                                                                 stopping, saves):
    assert checkpointer(tmp_path, config(every=every)).should_save(step, last=last, stopping=stopping) is saves


# ----- what a save holds ----------------------------------------------------------------------------


def test_a_save_holds_model_optimizer_position_random_state_global_batch_and_config(tmp_path):
    cfg = config(batch_size=4, grad_accum=2)
    c = checkpointer(tmp_path, cfg, world_size=1)
    model, opt = trained(0)
    path = c.save(model, opt, Position(step=6, epoch=1, batch=3))
    assert path == ckpt.checkpoint_dir(tmp_path) / "step-00000006.pt"
    assert c.watch.phases == ["checkpoint", "train"]  # its graphs are labelled, then training goes on
    state = ckpt.load_resumable(path)
    assert state["position"] == {"step": 6, "epoch": 1, "batch": 3}
    assert state["global_batch"] == 8 and state["config"] == cfg.to_dict()
    for name, value in weights(model).items():
        assert torch.equal(state["model"][name], value) and state["model"][name].device.type == "cpu"
    saved_opt = state["optimizer"]
    assert saved_opt["param_groups"][0]["lr"] == 1e-2 and len(saved_opt["state"]) == 2
    assert set(state["rng"]) == {"torch", "python", "xla"}


def test_the_global_batch_counts_every_rank_and_accumulation_step(tmp_path):
    assert checkpointer(tmp_path, config(batch_size=3, grad_accum=5), world_size=4).global_batch == 60


def test_a_rank_that_does_not_write_saves_nothing_and_returns_none(tmp_path):
    c = checkpointer(tmp_path, writes=False)
    model, opt = trained(0)
    assert c.save(model, opt, Position(step=2)) is None
    assert not ckpt.checkpoint_dir(tmp_path).exists() or not any(ckpt.checkpoint_dir(tmp_path).iterdir())
    assert c.watch.phases == ["checkpoint", "train"]


def test_zero1_saves_this_ranks_shard_and_marks_the_main_file_sharded(tmp_path):
    c = checkpointer(tmp_path, config(zero1=True))
    model, opt = trained(0)
    path = c.save(model, opt, Position(step=4))
    state = ckpt.load_resumable(path)
    assert state["optimizer"] == ckpt.sharded_marker(1)
    shard = ckpt.optimizer_state(path, state, zero1=True, world_size=1, rank=0)
    assert shard["param_groups"][0]["lr"] == 1e-2 and len(shard["state"]) == 2


def test_an_extracting_run_writes_no_shard(tmp_path):
    c = checkpointer(tmp_path, config(zero1=True), extracting=True)
    model, opt = trained(0)
    path = c.save(model, opt, Position(step=4))
    assert sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir()) == [path.name, path.name + ".sha256"]


# ----- resuming -------------------------------------------------------------------------------------


def test_a_resume_restores_weights_optimizer_and_position(tmp_path):
    model, opt = trained(0)
    path = checkpointer(tmp_path).save(model, opt, Position(step=6, epoch=1, batch=3))
    fresh, fresh_opt = trained(1)  # other weights, other moments
    assert not all(torch.equal(a, b) for a, b in zip(weights(fresh).values(), weights(model).values(), strict=True))
    pos, used = checkpointer(tmp_path, config(resume="latest")).resume(fresh, fresh_opt)
    assert (pos, used) == (Position(step=6, epoch=1, batch=3), path)
    for name, value in weights(model).items():
        assert torch.equal(weights(fresh)[name], value)
    for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p]["exp_avg"].cpu(), fresh_opt.state[q]["exp_avg"].cpu())


def test_a_resume_draws_the_random_numbers_the_saved_run_drew_next(tmp_path):
    model, opt = trained(0)
    checkpointer(tmp_path).save(model, opt, Position(step=2))

    def draws():  # the three generators a run uses: python (sifting, augmentation), torch (CPU), XLA (dropout)
        x = torch.rand(4, device=torch_xla.device())
        torch_xla.sync()  # the first step's sync, as in training: the seed advances here in both runs
        return random.random(), torch.rand(3).tolist(), x.cpu().tolist()

    first = draws()  # what the saved run drew next
    random.random()  # the generators move on
    torch.rand(5)
    xm.set_rng_state(12345)
    # resume syncs (a sync the saved run did not have, which advances the XLA seed) and restores the state
    checkpointer(tmp_path, config(resume="latest")).resume(model, opt)
    assert draws() == first


def test_a_resume_with_another_global_batch_is_one_line_naming_both(tmp_path):
    model, opt = trained(0)
    checkpointer(tmp_path, config(batch_size=4, grad_accum=2)).save(model, opt, Position(step=2))
    with pytest.raises(UsageError, match=r"trained with a global batch of 8, this run has 12: the data position"):
        checkpointer(tmp_path, config(batch_size=6, grad_accum=2, resume="latest")).resume(model, opt)


def test_a_resume_into_another_optimizer_is_one_line_naming_the_fix(tmp_path):
    model, opt = trained(0)
    checkpointer(tmp_path).save(model, opt, Position(step=2))
    other = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}], lr=1e-2)  # two groups
    with pytest.raises(UsageError, match=r"its optimizer state does not fit this run's optimizer \(loaded state "
                                         r"dict has a different number of parameter groups\): resume with the same "
                                         r"--optimizer and model"):
        checkpointer(tmp_path, config(resume="latest")).resume(model, other)


def test_a_resume_into_another_model_is_one_line_naming_the_checkpoint(tmp_path):
    model, opt = trained(0)
    path = checkpointer(tmp_path).save(model, opt, Position(step=2))
    wider = torch.nn.Linear(3, 5).to(torch_xla.device())
    with pytest.raises(UsageError, match=rf"^{path} does not fit this model: .*\[2, 3\] in the file, \[5, 3\]"):
        checkpointer(tmp_path, config(resume="latest")).resume(wider, torch.optim.AdamW(wider.parameters()))


def test_a_zero1_resume_loads_this_ranks_shard(tmp_path):
    model, opt = trained(0)
    checkpointer(tmp_path, config(zero1=True)).save(model, opt, Position(step=4))
    fresh, fresh_opt = trained(1)
    pos, _ = checkpointer(tmp_path, config(zero1=True, resume="latest")).resume(fresh, fresh_opt)
    assert pos.step == 4
    for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"].cpu(), fresh_opt.state[q]["exp_avg_sq"].cpu())
