"""A function of XLA tensors traced once, then run as its compiled graph with new inputs.

torch_xla's dynamo bridge runs a captured graph this way (torch_xla/_dynamo/dynamo_bridge.py): trace the
function lazily on the XLA device once, hash and compile the traced graph, keep which device data each of
its parameters is, and from then on launch it with `_run_cached_graph`. There it comes after dynamo has
traced the Python and aot_autograd has functionalised it. For dynamo-full's AdamW update (captured_update.py)
those two were most of the first step: on ViT-Tiny/16 (152 parameters, 760 tensors in) the update's first
call took 25 s, here 5.5 s (the lazy trace and XLA's compile); and every later call paid dynamo's guards
and aot_autograd's and the bridge's argument handling per tensor (docs/measurements.md, issue 45).

What that asks of the function, `fn(key, inputs) -> outputs`:
- every output is computed by the graph (new tensors), and no input is changed: the trace is dropped after
  it is compiled, so an in-place write would be lost (refused, naming the input);
- everything that varies between calls is an input tensor; anything else it reads (Python numbers, other
  device tensors) is baked in, so it belongs in `key`, with which tensors come in (their shapes and dtypes
  follow from them): one graph per key, as dynamo keeps one per set of guards;
- no random numbers (the graph would replay the trace's seed: refused) and no host reads (a trace-time
  value would be baked in).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

Fn = Callable[[Hashable, list[torch.Tensor]], list[torch.Tensor]]
_X = torch_xla._XLAC
SYNC_COUNTER = "CachedGraphSyncInput"  # torch_xla's metrics counter of those waits (the bridge's: DynamoSyncInput...)


@dataclass(frozen=True)
class _Graph:
    """A compiled graph: its hash, and for each of its parameters the input position or the traced value."""

    hash: object
    slots: tuple[tuple[int | None, torch.Tensor | None], ...]

    def arguments(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [inputs[k] if k is not None else v for k, v in self.slots]  # type: ignore[misc]


class CachedGraph:
    """`fn` (this module's docstring) as compiled graphs, one per key; call as `graph(key, inputs)`."""

    def __init__(self, fn: Fn) -> None:
        self.fn = fn
        self._graphs: dict[Hashable, _Graph] = {}

    def __call__(self, key: Hashable, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        pending = [t for t, p in zip(inputs, _X._check_tensor_need_materialization(inputs), strict=True) if p]
        if pending:
            # Sync point: an input is still pending IR (e.g. gradients summed over micro-batches); the graph
            # takes device data, so those tensors are computed first, as the dynamo bridge does.
            _X._xla_increment_counter(SYNC_COUNTER, 1)  # tests/training/test_step_launches.py counts these
            _X._xla_sync_multi(pending, devices=[], wait=True, sync_xla_data=True)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _trace(self.fn, key, inputs)
        return list(_X._run_cached_graph(graph.hash, graph.arguments(inputs)))


def _trace(fn: Fn, key: Hashable, inputs: list[torch.Tensor]) -> _Graph:
    """Trace `fn` once, compile its graph (not run), drop the trace. The syncs here advance the XLA seed;
    it is set back, so a run resumed from a checkpoint (compiling later) draws what the uninterrupted
    run draws (step.py's `_seed_keeping_compiler`, for the same reason)."""
    seed = xm.get_rng_state()
    # Sync point (once per graph): whatever else is pending runs now, so the trace below is all the
    # pending IR there is, and the wait makes the inputs' device data readable (not placeholders).
    torch_xla.sync()
    xm.wait_device_ops()
    device = str(inputs[0].device)
    try:
        outputs = fn(key, inputs)
        _check_traced(inputs, outputs)
        ids, values = _X._get_tensors_xla_device_data_node(outputs)
        if _X._get_seed_info_id() in ids:
            raise ValueError("the cached graph draws random numbers; each call would replay the same draw")
        position = {_X._xla_get_tensor_id(t): k for k, t in enumerate(inputs)}
        slots = tuple((position.get(i), None if i in position else v) for i, v in zip(ids, values, strict=True))
        with alias_with_buffer_donor_config():  # as the bridge compiles: no buffer is donated here
            graph_hash = _X._get_graph_hash(outputs)
            _X._xla_warm_up_cache(outputs, [])
    finally:
        _X._clear_pending_irs(device)  # the trace is never run: calls run the compiled graph
        xm.set_rng_state(seed)
    return _Graph(graph_hash, slots)


def _check_traced(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    changed = [k for k, p in enumerate(_X._check_tensor_need_materialization(inputs)) if p]
    if changed:
        raise ValueError(f"the cached graph's function changed its input {changed[0]} in place; return a "
                         "new tensor instead (a traced write is dropped after compiling)")
    if len({id(t) for t in outputs}) != len(outputs) or not all(_X._check_tensor_need_materialization(outputs)):
        raise ValueError("the cached graph's function returned an input or one tensor twice; "
                         "every output must be a new tensor the graph computes")
