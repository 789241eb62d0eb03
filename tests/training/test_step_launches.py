"""The captured step (`--step-compiler dynamo-full`, the CPU default) as the device sees it: what a
step launches, whether the host waits for the device inside it, and what the host copies after it
(issue 45)."""

from __future__ import annotations

import pytest

from tests.conftest import printed_json

# Our loop on vit-nano with the EMA on; before each step the device is drained
# and XLA's counters read: executions so far, the blocking input syncs so far (the dynamo bridge's and
# the cached update graph's), and the XLA tensor copies so far (aot_autograd's copy-back of the inputs a
# graph changed, set_lr's upload).
SCRIPT = '''
import json, sys
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from neuron_train.training.config_io import build_config
from neuron_train.training.device import init_backend, resolve_precision
from neuron_train.training.cached_graph import SYNC_COUNTER

cfg = resolve_precision(build_config(overrides={
    "model.name": "vit-nano", "train.max_steps": 6, "train.eval_every": 1000,
    "recipe.model_ema": True, "train.output_dir": sys.argv[1], "log.progress": False,
    "log.tensorboard": False, "data.num_workers": 0}))
from neuron_train.training.loop import Trainer

trainer = Trainer(cfg, init_backend())
counts, original = [], trainer.train_step

def counted(batches):
    xm.wait_device_ops()  # the earlier steps' executions have all finished (and been counted)
    counts.append([(met.metric_data("ExecuteTime") or (0,))[0],
                   sum(met.counter_value(c) or 0 for c in ("DynamoSyncInputExecuteTime", SYNC_COUNTER)),
                   met.counter_value("xla::_copy_from") or 0])
    original(batches)

trainer.train_step = counted
trainer.run()
print(json.dumps({"counts": counts, "params": len(list(trainer.model.parameters())),
                  "groups": len(trainer.step_path.optimizer.param_groups)}))
'''


@pytest.fixture(scope="module")
def captured_run(tmp_path_factory) -> dict:
    """One 6-step run of the script above: its counts before each step, and the model's sizes."""
    out = tmp_path_factory.mktemp("captured") / "run"
    return printed_json(SCRIPT, str(out), timeout=900)


@pytest.mark.slow
def test_a_captured_step_launches_forward_backward_and_one_update_without_waiting(captured_run):
    """Per steady step: forward, backward, and one update (clipping, AdamW and the EMA in one graph):
    3 executions, and no blocking sync. Before issue 45: torch.optim's graph breaks around
    `optimizer.step()` split the update into clipping, AdamW and the EMA (3 launches), and the backward
    first synced its incoming gradient (autograd's ones / accum, pending IR): the host waited for the
    forward to finish before it could launch the backward (6 executions, 1 wait a step).
    (With --grad-accum > 1 the accumulated gradients are still synced before the update: 1 wait.)"""
    counts = captured_run["counts"]
    per_step = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts[2:], counts[3:], strict=False)]  # after warm-up
    assert per_step and all(step == (3, 0) for step in per_step), per_step


@pytest.mark.slow
def test_a_captured_step_copies_back_no_weight_state_or_gradient(captured_run):
    """A steady step's host copies: the LR's upload, one per parameter group (set_lr): 2 here. Before
    issue 45, the update changed its inputs in place and aot_autograd copied each back after the graph:
    the weight, both AdamW moments, the step counter and the clipped gradient of every parameter, 5 per
    parameter a step (103 on vit-nano); then, until its graph returned new averages, the EMA's as well."""
    counts = captured_run["counts"]
    copies = [b[2] - a[2] for a, b in zip(counts[2:], counts[3:], strict=False)]  # after warm-up
    assert copies and all(n == captured_run["groups"] for n in copies), copies
    assert captured_run["params"] > 4  # one copy per parameter would show above
