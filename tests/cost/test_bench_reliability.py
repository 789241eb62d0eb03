"""Issue 12, bench's output: a directory, a path under a file or a read-only folder is refused before
anything is measured (one line, exit 2), and a result that cannot be written is printed instead,
leaving no temporary file. In-process through `neuron_train.cli.main`, without torch_xla.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

from neuron_train.common.errors import RunError
from neuron_train.cost.bench import instance
from neuron_train.cost.bench import result as bench_result
from neuron_train.cost.bench import sweep as bench_sweep
from neuron_train.training import build as training_build
from tests.precompile.test_reliability_cache import one_line, run


@pytest.fixture
def no_measuring(monkeypatch):
    """Anything that would start measuring fails the test: the refusals must come before it."""
    def measuring(*args, **kwargs):
        raise AssertionError("bench started measuring before refusing its --output")

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for module, name in ((training_build, "build_data"), (bench_sweep, "measure_train"),
                         (bench_sweep, "InferBench"), (instance, "detect_instance_type")):
        monkeypatch.setattr(module, name, measuring)

@pytest.mark.parametrize("force", [False, True])
def test_bench_refuses_a_directory_output_before_measuring(tmp_path, capsys, no_measuring, force):
    (tmp_path / "results").mkdir()
    code, _, err = run(capsys, "bench", "--mode", "infer", "--output", tmp_path / "results",
                       *(["--force"] if force else []))
    assert code == 2 and "is a directory" in one_line(err)

def test_bench_refuses_an_output_under_a_file_before_measuring(tmp_path, capsys, no_measuring):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "bench", "--mode", "infer", "--output", tmp_path / "notes.txt" / "r.json")
    assert code == 2 and "is not a folder" in one_line(err)

@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_bench_refuses_a_read_only_folder_before_measuring(tmp_path, capsys, no_measuring):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    code, _, err = run(capsys, "bench", "--mode", "infer", "--output", folder / "r.json")
    assert code == 2 and "not writable" in one_line(err)

def test_bench_prints_the_result_when_it_cannot_be_written_and_leaves_no_temporary_file(tmp_path, capsys,
                                                                                         monkeypatch):
    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(RunError, match="No space left on device; the result is printed above"):
        bench_result.write_result(tmp_path / "r.json", {"schema": "neuron-train-bench-result", "x": 1})
    assert json.loads(capsys.readouterr().out)["x"] == 1
    assert list(tmp_path.iterdir()) == []
