"""How the captured step's graphs are compiled (training/step.py's backend over torch_xla's dynamo
bridge): torch.fx's partitioner runs only for a graph with a node that falls back to the CPU, and such a
graph still computes on every call, not once at compile time (issue 45: the first step's start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import cpu_env

# Two functions captured the way the step is (step._captured), each called on two different inputs:
# one whose ops all lower to XLA, one with torch.digamma, which has no XLA lowering in torch_xla 2.9
# (it runs on the CPU). Printed: the partitioner's calls after each, and each result's largest error.
SCRIPT = '''
import json
import torch
import torch_xla
import torch_xla.debug.metrics as met
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from neuron_train.training.step import _captured

calls = []
propose = CapabilityBasedPartitioner.propose_partitions

def counted(self):
    calls.append(1)
    return propose(self)

CapabilityBasedPartitioner.propose_partitions = counted
functions = {"lowered": lambda a: (a * 2 + 1).softmax(0), "falls_back": lambda a: torch.digamma(a.abs() + 1) * 2}
out = {}
for name, fn in functions.items():
    captured, errors = _captured(fn), []
    for seed in (0, 1):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
        errors.append(float((captured(x.to(torch_xla.device())).cpu() - fn(x)).abs().max()))
    out[name] = {"partitions": len(calls), "errors": errors}
out["fallback_ops"] = met.executed_fallback_ops()
print(json.dumps(out))
'''


@pytest.mark.slow
def test_the_partitioner_runs_only_for_a_graph_that_falls_back_and_that_graph_still_computes_each_call():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=cpu_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["lowered"]["partitions"] == 0, out  # every op lowers: compiled whole, no partitioning
    assert max(out["lowered"]["errors"]) < 1e-5, out
    assert "aten::digamma" in out["fallback_ops"], out  # the premise: digamma does run on the CPU
    assert out["falls_back"]["partitions"] > 0, out
    # both calls right: the CPU op runs every call, it is not baked into the graph from the first input
    assert max(out["falls_back"]["errors"]) < 1e-4, out
