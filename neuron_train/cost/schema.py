"""The bench result file: one versioned JSON schema, written by `bench` and read by `report`.

Every field is required (null only where its type allows it); `validate_result` is the one check
both sides use, so a file `report` would refuse is never written.
"""

from __future__ import annotations

from neuron_train.common.errors import UsageError

SCHEMA_NAME = "neuron-train-bench-result"
SCHEMA_VERSION = 1
MODES = ("train", "infer")
_NUM = (int, float)
# dotted path -> accepted types. Every field is required (null only where the type allows it).
RESULT_FIELDS: dict[str, type | tuple] = {
    "schema": str, "schema_version": int, "created_at": str, "mode": str,
    "instance_type": str, "instance_type_source": str,
    "device.kind": str, "device.count": int,
    "world_size": int,
    "model.name": str, "model.parameters": int, "model.img_size": int, "model.num_classes": int,
    "dataset.name": str, "dataset.train_samples": int,
    "batch_size_per_device": int, "global_batch_size": int, "precision": str,
    "warmup_steps": int, "measured_steps": int, "repeats": int,
    "samples_per_sec.median": _NUM, "samples_per_sec.spread": _NUM, "samples_per_sec.values": list,
    "step_time_ms.median": _NUM, "step_time_ms.spread": _NUM, "step_time_ms.values": list,
    "compile.time_s": _NUM, "compile.graph_count": int,
    "sweep": (list, type(None)), "host": dict, "versions": dict, "command": str, "config": dict,
}
SWEEP_STATUSES = ("ok", "oom", "failed")


def _lookup(data: dict, dotted: str):
    node = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            raise KeyError(dotted)
        node = node[key]
    return node


def validate_result(data: object, where: str) -> dict:
    """Check a parsed result file against the schema; raise UsageError naming the first problem."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: not a bench result (expected a JSON object)")
    if data.get("schema") != SCHEMA_NAME:
        raise UsageError(f"{where}: not a bench result (schema is {data.get('schema')!r}, "
                         f"expected {SCHEMA_NAME!r})")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(f"{where}: schema_version {data.get('schema_version')!r} is not supported "
                         f"(this neuron-train reads version {SCHEMA_VERSION})")
    for dotted, kinds in RESULT_FIELDS.items():
        try:
            value = _lookup(data, dotted)
        except KeyError:
            raise UsageError(f"{where}: missing field '{dotted}'") from None
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise UsageError(f"{where}: field '{dotted}' has the wrong type ({type(value).__name__})")
    problems = _semantic_problems(data)
    if problems:
        raise UsageError(f"{where}: {problems[0]}")
    return data


def _semantic_problems(d: dict) -> list[str]:
    p = []
    if d["mode"] not in MODES:
        p.append(f"mode must be one of {', '.join(MODES)}, got {d['mode']!r}")
    if d["samples_per_sec"]["median"] <= 0 or d["step_time_ms"]["median"] <= 0:
        p.append("samples_per_sec and step_time_ms medians must be > 0")
    if min(d["world_size"], d["batch_size_per_device"], d["repeats"], d["device"]["count"]) < 1:
        p.append("world_size, batch_size_per_device, repeats and device.count must be >= 1")
    if d["global_batch_size"] % (d["batch_size_per_device"] * d["world_size"]) != 0:
        p.append(f"global_batch_size {d['global_batch_size']} is not a multiple of batch_size_per_device "
                 f"x world_size ({d['batch_size_per_device']} x {d['world_size']})")
    if len(d["samples_per_sec"]["values"]) != d["repeats"]:
        p.append(f"samples_per_sec.values has {len(d['samples_per_sec']['values'])} entries for "
                 f"{d['repeats']} repeats")
    for row in d["sweep"] or []:
        if not isinstance(row, dict) or row.get("status") not in SWEEP_STATUSES:
            p.append(f"sweep rows need a status in {', '.join(SWEEP_STATUSES)}")
            break
    return p

