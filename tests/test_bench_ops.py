"""scripts/bench_ops.py: the device's time per op, read from torch_xla's profiler trace.

The trace is an XSpace protobuf (.xplane.pb) that the script reads with its own small decoder. Here: a
trace written by hand (the wire format, built in this file) is read into the right ops, kinds and
graph executions; and a trace torch_xla's profiler really writes of a traced XLA CPU dot is read into
a `dot` op, which is the contract with the real file. The figures are in docs/measurements.md.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, cpu_env

sys.path.insert(0, str(ROOT / "scripts"))  # bench_ops imports bench_loop as its own directory's module
spec = importlib.util.spec_from_file_location("bench_ops", ROOT / "scripts" / "bench_ops.py")
bench_ops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_ops)

MS = 10**9  # ps


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def field(number: int, value: int | bytes | str) -> bytes:
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


def event(metadata_id: int, offset_ps: int, duration_ps: int) -> bytes:
    return field(1, metadata_id) + field(2, offset_ps) + field(3, duration_ps)


def line(name: str, timestamp_ns: int, *events: bytes) -> bytes:
    return field(2, name) + field(3, timestamp_ns) + b"".join(field(4, e) for e in events)


NAMES = {1: "dot.12", 2: "multiply_reduce_fusion.4.clone", 3: "call.7", 4: "Transpose::Execute",
         5: "ThunkExecutor::Execute", 6: "ThunkExecutor::Execute (wait for completion)", 7: "reduce-window"}


def xspace() -> bytes:
    metadata = b"".join(field(4, field(1, k) + field(2, field(1, k) + field(2, v))) for k, v in NAMES.items())
    eigen = line("tf_XLAEigen/123", 1_000,  # events' times are offsets from the line's timestamp (ns)
                 event(1, 0, 2 * MS), event(3, 3 * MS, 3 * MS // 2), event(2, 3 * MS, 7 * MS // 5),
                 event(4, 5 * MS, MS), event(1, 7 * MS, MS), event(7, 9 * MS, MS // 2))
    client = line("tf_XLAPjRtCpuClient/9", 0,  # an execution's inline part and its wait, then a wait alone
                  event(5, 0, MS // 2), event(6, MS // 2, 10 * MS), event(6, 20 * MS, 9 * MS // 2))
    host = line("python", 0, event(1, 0, 50 * MS))  # not an XLA thread: not an op of the device
    plane = field(2, "/host:CPU") + b"".join(field(3, x) for x in (eigen, client, host)) + metadata
    return field(1, plane)


def test_the_ops_kinds_and_executions_of_a_hand_written_trace():
    table = bench_ops.op_table(bench_ops.read_events(xspace()))
    assert dict(table.kinds) == {"dot": 3 * MS, "multiply_reduce_fusion": 7 * MS // 5, "reduce-window": MS // 2}
    assert table.kind_counts["dot"] == 2
    # `call` wraps the fusion (counted once, as the fusion), runtime events are not ops, `.clone` is dropped
    assert dict(table.ops) == {"dot.12": 3 * MS, "multiply_reduce_fusion.4": 7 * MS // 5,
                               "reduce-window": MS // 2}
    assert table.executions == [pytest.approx(10.5), pytest.approx(4.5)]  # inline + wait, then a wait alone
    text = bench_ops.format_table(table, steps=2, top=5)
    assert "graph executions per step (wall ms, median over 2 steps, in launch order): 7.5; sum 7.5" in text
    assert "1.50   61.2%      1.0/step  dot" in text  # 3 ms over 2 steps, of 4.9 ms of ops


def test_an_execution_that_ran_inline_to_its_end_is_one_of_its_own():
    names = field(4, field(1, 5) + field(2, field(2, "ThunkExecutor::Execute"))) + field(
        4, field(1, 6) + field(2, field(2, "ThunkExecutor::Execute (wait for completion)")))
    client = line("tf_XLAPjRtCpuClient/9", 0, event(5, 0, MS), event(5, 5 * MS, 2 * MS), event(6, 7 * MS, 3 * MS),
                  event(5, 20 * MS, MS // 2))
    events = bench_ops.read_events(field(1, field(3, client) + names))
    assert bench_ops.executions_ms(events) == [pytest.approx(1.0), pytest.approx(5.0), pytest.approx(0.5)]


def test_an_asynchronous_op_counts_to_its_end_mark():
    names = {1: "dot.1", 2: "end: dot.1", 3: "copy.2", 4: "end: call.3"}
    metadata = b"".join(field(4, field(1, k) + field(2, field(2, v))) for k, v in names.items())
    # two launches of dot.1 (1 ms each) done at 4 and 6 ms, marked on another thread; a copy with no mark
    eigen = line("tf_XLAEigen/1", 0, event(1, 0, MS), event(1, 2 * MS, MS), event(3, 3 * MS, MS // 2))
    client = line("tf_XLAPjRtCpuClient/2", 0, event(2, 4 * MS, 0), event(4, 5 * MS, 0), event(2, 6 * MS, 0))
    events = bench_ops.read_events(field(1, field(3, eigen) + field(3, client) + metadata))
    assert bench_ops.op_spans(events) == [("dot.1", 4 * MS), ("dot.1", 4 * MS), ("copy.2", MS // 2)]
    assert dict(bench_ops.op_table(events).kinds) == {"dot": 8 * MS, "copy": MS // 2}


def test_a_trace_without_xla_cpu_ops_is_refused_in_one_line():
    dot_named = field(4, field(1, 1) + field(2, field(2, "dot.1")))  # an op's name, on the host's thread
    host_only = field(1, field(3, line("python", 0, event(1, 0, MS))) + dot_named)
    with pytest.raises(SystemExit, match="holds no XLA CPU op.*PJRT_DEVICE=CPU"):
        bench_ops.device_ops(host_only)
    assert bench_ops.device_ops(xspace()).kinds["dot"] == 3 * MS


def test_op_kind_takes_hlo_instruction_names_only():
    assert bench_ops.op_kind("multiply_erf_fusion.clone") == "multiply_erf_fusion"
    assert bench_ops.op_kind("copy.84.clone") == "copy"
    assert bench_ops.op_kind("convolution") == "convolution"
    for runtime in ("call.163", "Transpose", "TransposePlan::ExecuteTyped", "D2H Dispatch", "end: dot.1"):
        assert bench_ops.op_kind(runtime) is None


def test_a_trace_torch_xla_writes_is_read_into_its_dot(tmp_path):
    code = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = {bench_ops.TRACE_FLAG!r}
        import torch, torch_xla, torch_xla.core.xla_model as xm, torch_xla.debug.profiler as xp
        a = torch.randn(64, 64).to(torch_xla.device())
        (a @ a).sum().item()  # compiled before the trace
        xp.start_trace({str(tmp_path)!r})
        (a @ a).sum().item()
        xm.wait_device_ops()
        xp.stop_trace()
    """)
    subprocess.run([sys.executable, "-c", code], env=cpu_env(), check=True, timeout=300)
    events = bench_ops.read_events(bench_ops.trace_file(tmp_path).read_bytes())
    table = bench_ops.op_table(events)
    assert table.kind_counts["dot"] == 1
    assert table.kinds["dot"] > 0
    ends = [e for e in events if e.name.startswith("end: dot")]
    assert len(ends) == 1  # the runtime marks the dot's end: the contract op_spans reads
    assert len(table.executions) == 1
