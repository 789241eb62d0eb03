"""ZeRO-1 (`--zero1`): sharded optimizer state that trains exactly like the unsharded optimizer.

Three levels: the flat-shard layout (pure), GlooZero1's algorithm in two real gloo processes on
the eager CPU device against a single-process AdamW reference (fast), and whole training runs on
the CPU XLA device at world size 1 (torch_xla's ZeroRedundancyOptimizer) and 2 (GlooZero1 over
the gloo bridge), with checkpoint/resume.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neuron_train.common.errors import UsageError
from neuron_train.training import checkpoint as ckpt
from neuron_train.training.zero1 import FlatLayout, GlooZero1, rank_major, state_bytes, unflatten
from tests.conftest import ROOT, run_train, summary_of

COMMON = ["--max-steps", "6", "--eval-every", "100", "--warmup-steps", "2"]


def weights_at(out, step: int) -> dict:
    return torch.load(out / "checkpoints" / f"step-{step:08d}.pt", weights_only=True)["model"]


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ----- the flat layout ----------------------------------------------------------------------
def test_layout_pads_to_whole_shards_and_round_trips():
    groups = [[torch.arange(6.0).view(2, 3), torch.arange(6.0, 7.0)], [torch.arange(7.0, 11.0)]]
    layouts = [FlatLayout((6, 1), 3), FlatLayout((4,), 3)]
    assert [(lay.total, lay.shard, lay.padded) for lay in layouts] == [(7, 3, 9), (4, 2, 6)]
    rows = rank_major(groups, layouts)
    assert rows.shape == (3, 5)  # rank r owns row r: 3 elements of group 0, 2 of group 1
    assert rows[0].tolist() == [0, 1, 2, 7, 8] and rows[2].tolist() == [6, 0, 0, 0, 0]
    assert unflatten(rows, layouts).tolist() == list(range(11))


# ----- GlooZero1 in two real processes (eager CPU tensors, gloo) ---------------------------
def _net() -> torch.nn.Module:
    torch.manual_seed(0)  # odd group sizes (85 and 29): the flat buffers need padding for 2 ranks
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 5),
                               torch.nn.Linear(5, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.05},
            {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]


def _gloo_worker(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    model, reference = _net(), _net()
    zero = GlooZero1(_groups(model), torch.optim.AdamW, world_size=world, rank=rank,
                     device=torch.device("cpu"), max_norm=0.5, lr=1e-2)
    plain = torch.optim.AdamW(_groups(reference), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    norms = []
    for step in range(5):
        x, y = torch.randn(4 * world, 5, generator=data), torch.randint(0, 3, (4 * world,), generator=data)
        for opt in (zero, plain):
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)  # as the loop's schedule does, on the wrapper
        mine = slice(4 * rank, 4 * (rank + 1))  # this rank's half of the global batch
        torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        zero.step()
        zero.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(reference(x), y).backward()  # the whole global batch
        norms.append((float(zero.grad_norm),
                      float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))))
        plain.step()
        plain.zero_grad(set_to_none=True)
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(),
                                                         strict=True))
    try:
        zero.load_state_dict({**zero.state_dict(), "rank": 1 - rank})
        refusal = ""
    except UsageError as exc:
        refusal = str(exc)
    torch.save({"diff": diff, "norms": norms, "bytes": state_bytes(zero), "plain": state_bytes(plain),
                "refusal": refusal}, f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo")
    mp.spawn(_gloo_worker, args=(2, str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.slow  # the fixture spawns two processes
def test_gloo_zero1_matches_one_process_adamw_with_global_norm_clipping(gloo_results):
    for r in gloo_results:
        assert r["diff"] < 1e-6, r["diff"]
        for zero_norm, reference_norm in r["norms"]:
            assert zero_norm == pytest.approx(reference_norm, rel=1e-5)
        assert any(reference_norm > 0.5 for _, reference_norm in r["norms"])  # clipping happened


@pytest.mark.slow  # the fixture spawns two processes
def test_gloo_zero1_keeps_half_the_optimizer_state_per_rank(gloo_results):
    assert sum(p.numel() for p in _net().parameters()) == 114  # 85 weights + 29 biases/norm scales
    for r in gloo_results:
        full = r["plain"]["optimizer_state_bytes"]
        assert full == 2 * 114 * 4 + 8 * 4  # exp_avg + exp_avg_sq (f32) + a step count per tensor
        # one flat shard per group: ceil(85 / 2) = 43 and ceil(29 / 2) = 15 elements on each rank
        assert r["bytes"]["optimizer_state_bytes"] == 2 * (43 + 15) * 4 + 2 * 4
        assert r["bytes"]["master_weight_bytes"] == (43 + 15) * 4
        assert r["bytes"]["optimizer_state_bytes"] < 0.52 * full


@pytest.mark.slow  # the fixture spawns two processes
def test_gloo_zero1_refuses_the_shard_of_another_rank(gloo_results):
    assert "saved by rank 1 of 2" in gloo_results[0]["refusal"]
    assert "saved by rank 0 of 2" in gloo_results[1]["refusal"]


# ----- shard files beside the checkpoint ----------------------------------------------------
def test_shards_are_written_beside_the_checkpoint_and_pruned_with_it(tmp_path):
    for step in (3, 6, 9):
        for rank in (0, 1):
            ckpt.save_shard(tmp_path, step, rank, {"rank": rank})
        ckpt.save(tmp_path, step, {"optimizer": ckpt.sharded_marker(2)}, keep_last=2)
    ckpt.save_shard(tmp_path, 12, 0, {"rank": 0})  # a crash before rank 0 committed step 12 ...
    ckpt.save_shard(tmp_path, 15, 0, {"rank": 0})
    for rank in (0, 1):
        ckpt.save_shard(tmp_path, 15, rank, {"rank": rank})
    ckpt.save(tmp_path, 15, {"optimizer": ckpt.sharded_marker(2)}, keep_last=2)
    names = sorted(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir())
    assert names == [  # each file with the SHA-256 saved beside it
        "step-00000009.optim-rank0.pt",
        "step-00000009.optim-rank0.pt.sha256",
        "step-00000009.optim-rank1.pt",
        "step-00000009.optim-rank1.pt.sha256",
        "step-00000009.pt",
        "step-00000009.pt.sha256",
        "step-00000015.optim-rank0.pt",
        "step-00000015.optim-rank0.pt.sha256",
        "step-00000015.optim-rank1.pt",
        "step-00000015.optim-rank1.pt.sha256",
        "step-00000015.pt",
        "step-00000015.pt.sha256"]


def test_resume_refuses_a_mismatched_optimizer_layout(tmp_path):
    main = ckpt.save(tmp_path, 3, {"optimizer": ckpt.sharded_marker(2)}, keep_last=1)
    state = ckpt.load(main)
    with pytest.raises(UsageError, match="saved with --zero1 on 2 ranks"):
        ckpt.optimizer_state(main, state, zero1=False, world_size=2, rank=0)
    with pytest.raises(UsageError, match="shards of 2 ranks, this run has 4"):
        ckpt.optimizer_state(main, state, zero1=True, world_size=4, rank=0)
    with pytest.raises(UsageError, match="optim-rank1.pt is missing"):
        ckpt.optimizer_state(main, state, zero1=True, world_size=2, rank=1)
    ckpt.save_shard(tmp_path, 3, 1, {"state": {}, "param_groups": []})
    assert ckpt.optimizer_state(main, state, zero1=True, world_size=2, rank=1) == {
        "state": {}, "param_groups": []}
    plain = {"optimizer": {"state": {}, "param_groups": []}}
    with pytest.raises(UsageError, match="saved without --zero1"):
        ckpt.optimizer_state(main, plain, zero1=True, world_size=1, rank=0)


# ----- whole runs on the CPU XLA device -----------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """World size 1: torch_xla's ZeroRedundancyOptimizer itself, and the same run without it."""
    tmp = tmp_path_factory.mktemp("zero1-one")
    runs = {}
    for name, extra in (("zero1", ["--zero1", "--checkpoint-every", "3"]), ("plain", [])):
        proc = run_train(tmp / name, *COMMON, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = tmp / name
    return runs


@pytest.mark.slow  # one_rank: two training runs (run.py) in subprocesses
def test_zero1_on_one_rank_trains_like_adamw(one_rank):
    diff = largest_difference(weights_at(one_rank["zero1"], 6), weights_at(one_rank["plain"], 6))
    assert diff < 1e-5, diff
    z, p = summary_of(one_rank["zero1"]), summary_of(one_rank["plain"])
    assert z["zero1"] is True and p["zero1"] is False
    # One rank holds all the moments either way, plus ZeRO's f32 master copy of the weights.
    assert z["optimizer_state_bytes_per_rank"] == p["optimizer_state_bytes_per_rank"]
    assert z["master_weight_bytes_per_rank"] == [4 * z["params"]] and p["master_weight_bytes_per_rank"] == [0]
    saved = sorted(x.name for x in (one_rank["zero1"] / "checkpoints").iterdir())
    assert saved == [  # each file with the SHA-256 saved beside it
        "step-00000003.optim-rank0.pt",
        "step-00000003.optim-rank0.pt.sha256",
        "step-00000003.pt",
        "step-00000003.pt.sha256",
        "step-00000006.optim-rank0.pt",
        "step-00000006.optim-rank0.pt.sha256",
        "step-00000006.pt",
        "step-00000006.pt.sha256"]


@pytest.mark.slow
def test_a_zero1_checkpoint_is_not_resumed_without_zero1(one_rank, tmp_path):
    proc = run_train(tmp_path / "run", *COMMON, "--resume",
                     str(one_rank["zero1"] / "checkpoints" / "step-00000003.pt"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "saved with --zero1 on 1 ranks" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bf16_zero1_resume_restores_the_f32_master_weights(tmp_path):
    args = [*COMMON, "--zero1", "--precision", "bf16", "--checkpoint-every", "3"]
    full = run_train(tmp_path / "full", *args)
    assert full.returncode == 0, full.stderr[-3000:]
    shard = torch.load(tmp_path / "full/checkpoints/step-00000003.optim-rank0.pt", weights_only=True)
    masters = shard["sharded_master_weights"]
    assert {m.dtype for m in masters.values()} == {torch.float32}
    # The masters carry precision the bf16 weights lost: resuming from the weights alone would drift.
    assert any((m != m.bfloat16().float()).any() for m in masters.values())

    start = tmp_path / "resumed" / "start"
    start.mkdir(parents=True)
    for f in (tmp_path / "full/checkpoints").glob("step-00000003*"):
        (start / f.name).write_bytes(f.read_bytes())
    resumed = run_train(tmp_path / "resumed/run", *args, "--resume", str(start / "step-00000003.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert largest_difference(weights_at(tmp_path / "resumed/run", 6), weights_at(tmp_path / "full", 6)) == 0


@pytest.mark.slow
def test_two_ranks_zero1_matches_plain_data_parallel_and_resumes_exactly(tmp_path):
    """World size 2 on CPU: GlooZero1 over the gloo bridge, with per-rank optimizer shard files."""
    args = [*COMMON, "--batch-size", "16"]
    zero = run_train(tmp_path / "zero1", *args, "--zero1", "--checkpoint-every", "3", nproc=2)
    assert zero.returncode == 0, zero.stderr[-3000:]
    plain = run_train(tmp_path / "plain", *args, nproc=2)
    assert plain.returncode == 0, plain.stderr[-3000:]
    diff = largest_difference(weights_at(tmp_path / "zero1", 6), weights_at(tmp_path / "plain", 6))
    assert diff < 1e-5, diff

    z, p = summary_of(tmp_path / "zero1"), summary_of(tmp_path / "plain")
    assert z["world_size"] == 2 and z["param_checksums"][0] == z["param_checksums"][1]
    full, sharded = p["optimizer_state_bytes_per_rank"], z["optimizer_state_bytes_per_rank"]
    assert len(sharded) == 2 and full[0] == full[1]
    for rank_bytes in sharded:  # half the moments each (+ padding and per-group step counters)
        assert abs(rank_bytes - full[0] / 2) < 0.001 * full[0]
    for rank_bytes in z["master_weight_bytes_per_rank"]:  # f32, half the weights each (+ padding)
        assert 0 <= rank_bytes - 2 * z["params"] <= 8

    start = tmp_path / "resumed" / "start"
    start.mkdir(parents=True)
    for f in (tmp_path / "zero1/checkpoints").glob("step-00000003*"):
        (start / f.name).write_bytes(f.read_bytes())
    assert sorted(f.name for f in start.iterdir()) == [  # each file with the SHA-256 saved beside it
        "step-00000003.optim-rank0.pt",
        "step-00000003.optim-rank0.pt.sha256",
        "step-00000003.optim-rank1.pt",
        "step-00000003.optim-rank1.pt.sha256",
        "step-00000003.pt",
        "step-00000003.pt.sha256"]
    resumed = run_train(tmp_path / "resumed/run", *args, "--zero1", "--resume",
                        str(start / "step-00000003.pt"), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert largest_difference(weights_at(tmp_path / "resumed/run", 6), weights_at(tmp_path / "zero1", 6)) == 0


@pytest.mark.neuron
def test_zero1_on_neuron_matches_plain_data_parallel(tmp_path):
    """torch_xla's ZeroRedundancyOptimizer with real XLA collectives on two NeuronCores."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "NEURON_EXTRACT_GRAPHS_ONLY")}
    env["PYTHONPATH"] = str(ROOT)
    args = [*COMMON, "--batch-size", "16"]
    for name, extra in (("zero1", ["--zero1"]), ("plain", [])):
        proc = run_train(tmp_path / name, *args, *extra, nproc=2, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    z, p = summary_of(tmp_path / "zero1"), summary_of(tmp_path / "plain")
    assert z["device"] == "NEURON" and z["world_size"] == 2
    assert all(b < 0.6 * p["optimizer_state_bytes_per_rank"][0] for b in z["optimizer_state_bytes_per_rank"])
    diff = largest_difference(weights_at(tmp_path / "zero1", 6), weights_at(tmp_path / "plain", 6))
    assert diff < 1e-3, diff  # reduce-scatter vs all-reduce: another summation order on the device
