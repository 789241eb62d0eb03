"""The captured step (`--step-compiler dynamo-full`, the CPU default) as the device sees it: what a
step launches and whether the host waits for the device inside it (issue 45)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import cpu_env

# Our loop on vit-nano with the EMA on; before each step the device is drained
# and XLA's counters read: executions so far, and the dynamo bridge's blocking input syncs so far.
SCRIPT = '''
import json, sys
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from neuron_train.training.config_io import build_config
from neuron_train.training.device import init_backend, resolve_precision

cfg = resolve_precision(build_config(overrides={
    "model.name": "vit-nano", "train.max_steps": 6, "train.eval_every": 1000,
    "recipe.model_ema": True, "train.output_dir": sys.argv[1], "log.progress": False,
    "log.tensorboard": False, "data.num_workers": 0}))
from neuron_train.training.loop import Trainer

trainer = Trainer(cfg, init_backend())
counts, original = [], trainer.train_step

def counted(batches):
    xm.wait_device_ops()  # the earlier steps' executions have all finished (and been counted)
    counts.append([(met.metric_data("ExecuteTime") or (0,))[0], met.counter_value("DynamoSyncInputExecuteTime") or 0])
    original(batches)

trainer.train_step = counted
trainer.run()
print(json.dumps(counts))
'''


@pytest.mark.slow
def test_a_captured_step_launches_forward_backward_and_one_update_without_waiting(tmp_path):
    """Per steady step: forward, backward, and one update (clipping, AdamW and the EMA in one graph):
    3 executions, and no blocking sync. Before issue 45: torch.optim's graph breaks around
    `optimizer.step()` split the update into clipping, AdamW and the EMA (3 launches), and the backward
    first synced its incoming gradient (autograd's ones / accum, pending IR): the host waited for the
    forward to finish before it could launch the backward (6 executions, 1 wait a step).
    (With --grad-accum > 1 the accumulated gradients are still synced before the update: 1 wait.)"""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], env=cpu_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    per_step = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts[2:], counts[3:], strict=False)]  # after warm-up
    assert per_step and all(step == (3, 0) for step in per_step), per_step
