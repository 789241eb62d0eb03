"""How the captured step's graphs are compiled (training/step.py's backend over torch_xla's dynamo
bridge): torch.fx's partitioner runs only for a graph with a node that falls back to the CPU, and such a
graph still computes on every call, not once at compile time (issue 45: the first step's start-up); the
backward graph (min-cut partition) takes gradients through the forward's random draws."""

from __future__ import annotations

import pytest

from tests.conftest import printed_json

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
    out = printed_json(SCRIPT)
    assert out["lowered"]["partitions"] == 0, out  # every op lowers: compiled whole, no partitioning
    assert max(out["lowered"]["errors"]) < 1e-5, out
    assert "aten::digamma" in out["fallback_ops"], out  # the premise: digamma does run on the CPU
    assert out["falls_back"]["partitions"] > 0, out
    # both calls right: the CPU op runs every call, it is not baked into the graph from the first input
    assert max(out["falls_back"]["errors"]) < 1e-4, out


# Drop-path's draw (timm: `x.new_empty(shape).bernoulli_(keep)`) captured the way the step is. The
# backward must use the forward's mask: a partition that recomputed the draw in the backward graph would
# take gradients through another mask (the min-cut partition does, to save only x, once torch's bars on
# recomputing random ops and tensors the backward reads are lifted: seen, error 1.0). Printed: the
# gradient's largest error against the mask read from the forward's output (sin(x) > 0.003 for these
# x, so an output equal to x * x is a dropped element).
DROP_SCRIPT = '''
import json
import torch
import torch_xla
from neuron_train.training.step import _captured

def drop(x):
    keep = x.new_empty(x.shape).bernoulli_(0.5)
    return torch.sin(x * keep) + x * x

x = (torch.arange(1.0, 257.0) / 256).reshape(16, 16).to(torch_xla.device()).requires_grad_()
y = _captured(drop)(x)
y.sum().backward()
xd = x.detach()
kept = ((y.detach() - xd * xd).abs() > 1e-3).float()
expected = torch.cos(xd * kept) * kept + 2 * xd
print(json.dumps({"error": float((x.grad - expected).abs().max()), "kept": int(kept.sum())}))
'''


@pytest.mark.slow
def test_the_captured_backward_takes_gradients_through_the_forward_s_random_mask():
    out = printed_json(DROP_SCRIPT)
    assert 0 < out["kept"] < 256, out  # the premise: some elements dropped, some kept
    assert out["error"] < 1e-5, out
