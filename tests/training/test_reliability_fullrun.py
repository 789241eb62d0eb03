"""Issue 21, round 3: a disk that fills up while a run writes metrics.jsonl, graphs.json or
summary.json. One line (`no space left on DIR`), exit 1, no half-written file, the last good
checkpoint named; `--resume` after freeing space finishes the run with every record once.
A real tmpfs that fills up (tests/fullfs.py); the runs are real `neuron-train train` runs (in-process).
"""

from __future__ import annotations

import json

import pytest

from neuron_train import cli
from neuron_train.training import checkpoint as ckpt
from neuron_train.training import rundir
from neuron_train.training.metrics import MetricsWriter
from tests.conftest import FAST, NANO
from tests.fullfs import fill, mounted_tmpfs


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "NEURON_EXTRACT_GRAPHS_ONLY"):
        monkeypatch.delenv(var, raising=False)
    yield
    rundir.release_unused()


def whole_records(path) -> list[dict]:
    """Every line of a metrics file, each whole (a cut line fails the test)."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), data[-200:]
    return [json.loads(line) for line in data.decode().splitlines()]


def test_a_metrics_record_that_does_not_fit_leaves_no_cut_line(tmp_path):
    with mounted_tmpfs(tmp_path / "small", size="1m") as small:
        writer = MetricsWriter(small, tensorboard=False)
        writer.write(0, {"loss": 1.0})
        fill(small)
        step = 1
        while writer.error is None and step < 10_000:  # appends fit in the file's last page, then not
            writer.write(step, {"loss": 1.0, "pad": "x" * 100})
            step += 1
        writer.close()
        assert writer.error is not None and writer.failed_step == step - 1
        records = whole_records(small / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(step - 1))


def train(out, *argv) -> int:
    return cli.main(["train", "--output-dir", str(out), *NANO, *FAST, "--batch-size", "8", *argv])


@pytest.mark.slow
def test_a_full_disk_while_metrics_are_appended_is_one_line_and_resume_finishes(tmp_path, capsys, monkeypatch):
    run = tmp_path / "small" / "run"
    save = ckpt.save

    def save_then_fill(run_dir, step, state, keep_last):  # the disk fills up right after step 50's save
        path = save(run_dir, step, state, keep_last)
        fill(run_dir)
        return path

    with mounted_tmpfs(tmp_path / "small", size="16m"):
        monkeypatch.setattr(ckpt, "save", save_then_fill)
        args = ["--max-steps", "100", "--checkpoint-every", "50", "--log-every", "1", "--eval-every", "0"]
        assert train(run, *args) == 1
        err = capsys.readouterr().err.strip().splitlines()
        last = ckpt.checkpoint_dir(run) / "step-00000050.pt"
        assert err[-1].startswith(f"neuron-train train: no space left on {run} (0 MiB free): metrics.jsonl "
                                  "holds no records from step "), err[-1]
        assert err[-1].endswith(f"; the last good checkpoint is {last}; free some space, then continue "
                                "with --resume"), err[-1]
        steps = [r["step"] for r in whole_records(run / "metrics.jsonl") if r["kind"] == "train"]
        assert steps[:51] == list(range(51)) and len(steps) < 100  # steps after 50 fit until the page was full
        assert not (run / "summary.json").exists() and not [p for p in run.rglob("*") if ".tmp" in p.name]

        monkeypatch.setattr(ckpt, "save", save)
        (run / "filler").unlink()
        assert train(run, *args, "--resume") == 0
        steps = [r["step"] for r in whole_records(run / "metrics.jsonl") if r["kind"] == "train"]
        assert steps == list(range(100))  # every record once: the resumed run logged 50.. again
        assert json.loads((run / "summary.json").read_text())["steps"] == 100


@pytest.mark.slow  # two training runs each (in-process): 7-40 s
@pytest.mark.parametrize("name", ["graphs.json", "summary.json"])
def test_a_full_disk_while_the_run_files_are_written_is_one_line_and_leaves_none_half_written(
        tmp_path, capsys, monkeypatch, name):
    from neuron_train.training import loop

    run = tmp_path / "small" / "run"
    write = loop.write_json_atomic

    def fill_then_write(path, data):  # the disk fills up as the run's last files are written
        if path.name == name:
            fill(path.parent)
        write(path, data)

    with mounted_tmpfs(tmp_path / "small", size="16m"):
        monkeypatch.setattr(loop, "write_json_atomic", fill_then_write)
        assert train(run, "--max-steps", "2") == 1
        err = capsys.readouterr().err.strip().splitlines()
        last = ckpt.checkpoint_dir(run) / "step-00000002.pt"
        assert err[-1] == (f"neuron-train train: no space left on {run} (0 MiB free): {name} was not written; "
                           f"the last good checkpoint is {last}; free some space, then continue with --resume")
        assert not (run / "summary.json").exists()  # graphs.json first, summary.json (the run is done) last
        assert (run / "graphs.json").exists() == (name == "summary.json")
        assert not [p for p in run.rglob("*") if ".tmp" in p.name]
