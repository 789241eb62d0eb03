"""training/checkpoint_format.py in-process: what a checkpoint must hold to be resumed, and its checksum.

Each case is one entry a resume reads, damaged the way a crafted or corrupted file could be: the
check names it in one line, before any of it is used (a resume that read it would stop with a
KeyError half-way through start-up, or continue from the wrong place). Written to kill the mutants
that survived a mutation run of the module (docs/measurements.md, "Scores").
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from neuron_train.training.checkpoint_format import (
    checksum_file,
    checksum_line,
    checksum_problem,
    structure_problem,
)


def good() -> dict:
    return {"model": {"w": torch.zeros(2)},
            "optimizer": {"state": {}, "param_groups": [{"params": [0], "lr": 1e-3}]},
            "position": {"step": 6, "epoch": 0, "batch": 6},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "xla": 0},
            "global_batch": 8,
            "config": {"model": {"name": "vit-nano", "img_size": 32}, "train": {"batch_size": 8, "grad_accum": 1}}}


def test_a_checkpoint_with_every_entry_passes():
    assert structure_problem(good()) is None
    state = good()
    state["position"] = {"step": 0, "epoch": 0, "batch": 0}  # the very start is a position too
    state["global_batch"] = 1
    state["rng"]["python"] = list(state["rng"]["python"])  # as a list after some loaders: still 3 items
    assert structure_problem(state) is None


def test_a_zero1_checkpoint_needs_only_the_marker_of_its_shards():
    state = good()
    for ranks in (1, 2):  # one rank is a valid (degenerate) ZeRO-1 run
        state["optimizer"] = {"sharded": "zero1", "world_size": ranks}
        assert structure_problem(state) is None
    state["optimizer"]["world_size"] = 0
    assert structure_problem(state) == "'optimizer.world_size' must be an integer >= 1"
    state["optimizer"] = {"sharded": "zero1"}
    assert structure_problem(state) == "'optimizer.world_size' must be an integer >= 1"


def _set(path: str, value):
    def apply(state: dict) -> None:
        *parents, last = path.split(".")
        target = state
        for key in parents:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value
    return apply


BREAKS = [
    (_set("model", KeyError), "it has no 'model' entry"),
    (lambda s: [s.pop(k) for k in ("rng", "config")], "it has no 'rng', 'config' entries"),
    (_set("model", []), "'model' must be a dictionary, got list"),
    (_set("optimizer", None), "'optimizer' must be a dictionary, got NoneType"),
    (_set("rng", 3), "'rng' must be a dictionary, got int"),
    (_set("config", "vit-nano"), "'config' must be a dictionary, got str"),
    (_set("global_batch", 0), "'global_batch' must be an integer >= 1, got 0"),
    (_set("global_batch", True), "'global_batch' must be an integer >= 1, got True"),
    (_set("global_batch", 8.0), "'global_batch' must be an integer >= 1, got 8.0"),
    (_set("position.batch", KeyError), "'position' must hold exactly step, epoch, batch, got ['epoch', 'step']"),
    (_set("position.epoch", -1), "'position.epoch' must be an integer >= 0, got -1"),
    (_set("position.batch", "6"), "'position.batch' must be an integer >= 0, got '6'"),
    (_set("config.model", "vit-nano"), "'config.model.name' must be a string, got None"),
    (_set("config.model.name", 5), "'config.model.name' must be a string, got 5"),
    (_set("config.model.img_size", 0), "'config.model.img_size' must be an integer >= 1, got 0"),
    (_set("config.train.batch_size", False), "'config.train.batch_size' must be an integer >= 1, got False"),
    (_set("config.train.grad_accum", KeyError), "'config.train.grad_accum' must be an integer >= 1, got None"),
    (_set("rng.torch", torch.zeros(4)), "'rng.torch' must be torch's RNG state (a uint8 tensor)"),
    (_set("rng.torch", KeyError), "'rng.torch' must be torch's RNG state (a uint8 tensor)"),
    (_set("rng.python", (3, (1, 2))), "'rng.python' must be Python's random state (3 items)"),
    (_set("rng.python", "abc"), "'rng.python' must be Python's random state (3 items)"),
    (_set("rng.xla", -1), "'rng.xla' must be an integer >= 0, got -1"),
    (_set("rng.xla", KeyError), "'rng.xla' must be an integer >= 0, got None"),
    (_set("optimizer.state", []),
     "'optimizer' holds no optimizer state (it needs 'state' and non-empty 'param_groups')"),
    (_set("optimizer.param_groups", []), "'optimizer' holds no optimizer state"),
    (_set("optimizer.param_groups", {"params": [0]}), "'optimizer' holds no optimizer state"),
    (_set("optimizer.param_groups", [{"params": [0]}, "x"]), "'optimizer' holds no optimizer state"),
    (_set("optimizer.param_groups", [{"lr": 1.0}]), "'optimizer' holds no optimizer state"),
    (_set("model", {}), "'model' holds no weights"),
    (_set("model", {"w": torch.zeros(2), "b": [0.0]}), "'model' entry 'b' is not a tensor"),
]


@pytest.mark.parametrize("damage, problem", BREAKS, ids=[p for _, p in BREAKS])
def test_each_damaged_entry_is_named_in_one_line(damage, problem):
    state = good()
    damage(state)
    found = structure_problem(state)
    assert found is not None and found.startswith(problem), found
    assert "\n" not in found


def test_the_first_problem_is_named_in_the_order_a_resume_reads():
    state = good()
    state["position"]["step"] = -1
    state["model"] = {}
    assert structure_problem(state).startswith("'position.step'")


# ----- the checksum beside the file ---------------------------------------------------------------


def test_the_checksum_line_is_sha256sum_format_under_the_final_name(tmp_path):
    data = tmp_path / ".step-00000006.pt.tmp-host-1"
    data.write_bytes(b"weights")
    assert checksum_line(data, "step-00000006.pt") == f"{hashlib.sha256(b'weights').hexdigest()}  step-00000006.pt\n"
    assert checksum_file(tmp_path / "step-00000006.pt") == tmp_path / "step-00000006.pt.sha256"


def test_a_file_without_checksum_is_unverified_and_a_matching_one_passes(tmp_path):
    data = tmp_path / "step-00000006.pt"
    data.write_bytes(b"weights")
    assert checksum_problem(data) is None
    checksum_file(data).write_text(checksum_line(data, data.name))
    assert checksum_problem(data) is None


@pytest.mark.parametrize("side, problem", [
    (b"", "its checksum file step-00000006.pt.sha256 holds no SHA-256 line"),
    (b"0" * 64 + b"  step-00000006.pt\n", "its SHA-256 differs from the one saved with it"),
    (b"\xff\xfe\x00garbage  step-00000006.pt\n", "its checksum file step-00000006.pt.sha256 holds no SHA-256 line"),
])
def test_a_damaged_or_mismatching_checksum_is_one_line(tmp_path, side, problem):
    data = tmp_path / "step-00000006.pt"
    data.write_bytes(b"weights")
    checksum_file(data).write_bytes(side)
    assert checksum_problem(data).startswith(problem)
