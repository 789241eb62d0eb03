"""Guards that each killed a mutant which survived the rest of the suite (issue 22): every test here
fails with its guard removed (docs/testing.md lists the mutant, the break and the test).

Pure and fast: the checker's two warmth/cause rules, `..` in manifest keys and in archive members,
the LR schedule's 0/1 guard through the real schedule, and the gradient average of two gloo ranks.
"""

from __future__ import annotations

import io
import math
import tarfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_cache import CONFIG, add_config, xla_entry
from test_graphs import ACCESS, LIBS, ran, run_site, sync_event, window

from neuron_train.common.errors import RunError
from neuron_train.graphs import causes, records
from neuron_train.graphs.analyzer import Analyzer
from neuron_train.graphs.log import Frame
from neuron_train.precompile import archive, store
from neuron_train.precompile.manifest import GraphRecord, Manifest, ManifestError, is_cache_file_path
from neuron_train.training.config import OptimConfig
from neuron_train.training.optim import lr_at

# ----- the checker (M01, M04) ---------------------------------------------------------------------


def test_a_graph_repeating_at_a_second_site_warms_that_site():
    """M01. Graph A is compiled at line 10, then flushed twice by a sync at line 20 (a clock, an
    eval): line 20 has run a graph again, so it is warm and a new graph there is a recompilation."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    run_site(analyzer, "A", "A")
    for step in (3, 4):
        assert analyzer.observe(window(step, sync_event("execute", "A", 20))) == []
    [new] = analyzer.observe(window(5, *ran("B", 20)))
    assert (new.hash, new.kind) == ("B", "recompile")


def test_a_late_graph_made_by_a_host_read_names_the_read():
    """M04. A site first seen once the run is steady, whose graph a value branch compiled: a late
    graph whose cause is the read, not "new call site"."""
    analyzer = Analyzer(warmup_steps=0, is_internal=LIBS)
    run_site(analyzer, "A", "A")
    branch = Frame("__bool__", "/lib/torch/_tensor.py", 1)  # `if loss > x:` first run at step 3
    read = window(3, *ran("R", 12, cause=ACCESS, inner=branch), sync_event("execute", "A", 10),
                  reads=[records.HostRead("bool", "/u/t.py:12", "train")])
    analyzer.observe(read)
    late = analyzer.graphs["R"]
    assert late.kind == "late" and late.where == "/u/t.py:12"
    assert late.cause == causes.VALUE_BRANCH != causes.NEW_CALL_SITE


# ----- `..` in manifest keys (M09) and archive members (M10) ----------------------------------------
NEURON_MODULE = "neuronxcc-2.0.0.22266a0+a69f71e55/MODULE_9219523464496887986+abb26765"


@pytest.mark.parametrize("key", ["xla/..", f"{NEURON_MODULE}/../../../x", f"{NEURON_MODULE}/sub/../x"])
def test_a_manifest_key_with_dot_dot_is_refused_even_when_its_shape_fits(key):
    """Each has the shape of a cache file (`xla/NAME`, `neuronxcc-*/MODULE_*/FILE...`): only the
    `..` check refuses it."""
    assert not is_cache_file_path(key)
    raw = {"format": "neuron-train-graph-manifest", "version": 1, "configs": {},
           "files": {key: {"sha256": "0" * 64, "size": 1, "recorded": "2026-11-01T00:00:00Z", "recorded_by": "fp"}}}
    with pytest.raises(ManifestError, match="not a file of a compile cache"):
        Manifest.from_json(raw, "m.json")


def _packed(tmp_path):
    cache = tmp_path / "cache"
    xla_entry(cache, "67939951107342009493273238831484768838")
    add_config(cache, "aaaaaaaaaaaaaaaa", CONFIG, {"h1": GraphRecord(phase="train", step=0)})
    good = tmp_path / "good.tar.gz"
    archive.pack(cache, str(good))
    return good


@pytest.mark.parametrize("name", ["xla/../../escaped", "xla/../escaped"])
def test_an_archive_member_with_dot_dot_is_refused_before_anything_is_extracted(tmp_path, name):
    """M10. A packed archive plus one member whose name climbs out: refused by name, in one line, and
    the destination cache gets nothing."""
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(_packed(tmp_path)) as src, tarfile.open(bad, "w:gz") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        evil = tarfile.TarInfo(name)
        evil.size = 4
        dst.addfile(evil, io.BytesIO(b"evil"))
    dest = tmp_path / "dst" / "cache"
    with pytest.raises(RunError, match=r"is not a plain relative file: refusing to unpack"):
        archive.unpack(str(bad), dest)
    assert not list(tmp_path.rglob("escaped"))
    assert not (dest / store.MANIFEST).exists() and not (dest / store.XLA_DIR).exists()


# ----- the LR schedule never hands out exactly 0 or 1 (M23, M24) ------------------------------------
@pytest.mark.parametrize("schedule, warmup", [("cosine", 0), ("linear", 0), ("constant", 0), ("cosine", 3)])
def test_the_schedule_from_and_to_the_special_values_never_hands_them_out(schedule, warmup):
    """Peak LR 1 and a decay to min LR 0 (values XLA bakes into the graph as constants): the real
    schedule reaches both ends of the range within a hair but never exactly 0 or 1."""
    cfg = OptimConfig(optimizer="sgd", lr=1.0, min_lr=0.0, schedule=schedule, warmup_steps=warmup)
    lrs = [lr_at(step, cfg, total_steps=10) for step in range(14)]
    assert all(0.0 < lr < 1.0 for lr in lrs), lrs
    assert max(lrs) == pytest.approx(1.0, abs=1e-12)
    if schedule != "constant":
        assert lrs[-1] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_schedule_warms_up_linearly_then_decays_to_min_lr(schedule):
    """Warm-up over 4 steps to peak 0.8: k/5 of it at step k-1; then the decay over the 8 steps left:
    a quarter of the way at step 6, half-way between peak and min at step 8, min from step 12 on."""
    cfg = OptimConfig(lr=0.8, min_lr=0.2, schedule=schedule, warmup_steps=4)
    assert [lr_at(k, cfg, total_steps=12) for k in range(4)] == pytest.approx([0.16, 0.32, 0.48, 0.64])
    assert lr_at(4, cfg, total_steps=12) == pytest.approx(0.8)
    if schedule == "constant":
        assert [lr_at(k, cfg, total_steps=12) for k in (8, 12, 30)] == pytest.approx([0.8] * 3)
        return
    assert lr_at(8, cfg, total_steps=12) == pytest.approx(0.5)
    quarter = 0.2 + 0.6 * (0.5 * (1 + math.cos(math.pi / 4)) if schedule == "cosine" else 0.75)
    assert lr_at(6, cfg, total_steps=12) == pytest.approx(quarter)
    assert [lr_at(k, cfg, total_steps=12) for k in (12, 30)] == pytest.approx([0.2, 0.2])
    # one step of decay: the step after the warm-up is already at min LR
    assert [lr_at(k, cfg, total_steps=5) for k in (4, 5)] == pytest.approx([0.8, 0.2])


# ----- gloo gradient averaging (M26) ------------------------------------------------------------------
def _average_rank(rank: int, world: int, port: int) -> list[float]:
    from neuron_train.training.device import _gloo_average

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        p = torch.nn.Parameter(torch.zeros(3))
        q = torch.nn.Parameter(torch.zeros(2))
        r = torch.nn.Parameter(torch.zeros(2, 2))  # three tensors: each must get its own slice back
        p.grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        q.grad = torch.tensor([10.0, -4.0]) * (rank + 1)
        r.grad = torch.tensor([[5.0, 6.0], [7.0, 8.0]]) * (rank + 1)
        _gloo_average(torch.optim.SGD([p, q, r], lr=0.1), world, torch.device("cpu"))
        return torch.cat([p.grad, q.grad, r.grad.reshape(-1)]).tolist()
    finally:
        dist.destroy_process_group()


def _second_rank(port: int, out) -> None:
    out.put(_average_rank(1, 2, port))


@pytest.mark.slow  # a forked torch process is rank 1
def test_two_gloo_ranks_average_their_gradients_not_sum_them():
    """Ranks holding g and 2g both end with 1.5g: the mean (a sum would give 3g). This process is
    rank 0, a forked one rank 1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    other = ctx.Process(target=_second_rank, args=(port, out))
    other.start()
    mine = _average_rank(0, 2, port)
    theirs = out.get(timeout=120)
    other.join(timeout=60)
    expected = [1.5 * v for v in (1.0, 2.0, 3.0, 10.0, -4.0, 5.0, 6.0, 7.0, 8.0)]
    assert mine == theirs == pytest.approx(expected, abs=1e-6)
    assert not math.isclose(mine[0], 3.0)
