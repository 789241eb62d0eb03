"""training/checkpoint.py in-process: saving, pruning, cleaning after a crash, and loading safely.

The training tests reach this module inside training subprocesses, where mutmut cannot see it;
these check its promises as function calls (docs/measurements.md, "Scores"): the last K checkpoints and
only they are kept (with their checksums and shards), a killed save's leftovers are removed and
nothing else, a file that is not a whole checkpoint of ours is one line naming why, and the newest
good checkpoint is found past damaged ones.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import zipfile
from pathlib import Path

import pytest
import torch

from neuron_train.common.errors import RunError, UsageError
from neuron_train.training import checkpoint as ckpt
from neuron_train.training import checkpoint_format as fmt
from neuron_train.training.checkpoint_format import checksum_file, structure_problem

CONFIG = {"model": {"name": "vit-nano", "img_size": 32}, "train": {"batch_size": 4, "grad_accum": 2, "seed": 7}}


def state(step: int, **changes) -> dict:
    s = {"model": {"w": torch.full((2,), float(step))},
         "optimizer": {"state": {}, "param_groups": [{"params": [0], "lr": 1e-3}]},
         "position": {"step": step, "epoch": 0, "batch": step},
         "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "xla": 0},
         "global_batch": 16, "config": CONFIG}
    return s | changes


def names(run_dir) -> list[str]:
    return sorted(p.name for p in ckpt.checkpoint_dir(run_dir).iterdir())


# ----- saving and keeping the last K --------------------------------------------------------------------


def test_a_save_writes_the_file_and_its_checksum_and_keeps_only_the_last_k(tmp_path):
    for step in (2, 4, 6, 8):
        path = ckpt.save(tmp_path, step, state(step), keep_last=2)
        assert path == ckpt.checkpoint_dir(tmp_path) / f"step-{step:08d}.pt"
    assert names(tmp_path) == ["step-00000006.pt", "step-00000006.pt.sha256",
                               "step-00000008.pt", "step-00000008.pt.sha256"]
    loaded = ckpt.load_resumable(ckpt.checkpoint_dir(tmp_path) / "step-00000008.pt")
    assert loaded["format"] == ckpt.FORMAT and loaded["position"]["step"] == 8
    assert torch.equal(loaded["model"]["w"], torch.full((2,), 8.0))


def test_zero1_shards_are_kept_and_pruned_with_their_checkpoint(tmp_path):
    for step in (2, 4):
        for rank in (0, 1):
            ckpt.save_shard(tmp_path, step, rank, {"state": {}, "param_groups": [], "rank": rank})
        ckpt.save(tmp_path, step, state(step, optimizer=ckpt.sharded_marker(2)), keep_last=2)
    assert len(names(tmp_path)) == 12  # both checkpoints, each with two shards, each file with its checksum
    ckpt.save_shard(tmp_path, 6, 0, {"rank": 0})  # a crash after this shard, before the main file
    ckpt.save(tmp_path, 8, state(8, optimizer=ckpt.sharded_marker(2)), keep_last=1)
    assert names(tmp_path) == ["step-00000008.pt", "step-00000008.pt.sha256"]


def test_the_shard_of_a_kept_checkpoint_is_the_one_each_rank_resumes(tmp_path):
    for rank in (0, 1):
        ckpt.save_shard(tmp_path, 4, rank, {"state": {}, "param_groups": [], "rank": rank})
    path = ckpt.save(tmp_path, 4, state(4, optimizer=ckpt.sharded_marker(2)), keep_last=3)
    assert names(tmp_path) == ["step-00000004.optim-rank0.pt", "step-00000004.optim-rank0.pt.sha256",
                               "step-00000004.optim-rank1.pt", "step-00000004.optim-rank1.pt.sha256",
                               "step-00000004.pt", "step-00000004.pt.sha256"]
    loaded = ckpt.load(path)
    assert ckpt.optimizer_state(path, loaded, zero1=True, world_size=2, rank=1) == {
        "state": {}, "param_groups": [], "rank": 1}
    (ckpt.checkpoint_dir(tmp_path) / "step-00000004.optim-rank1.pt").unlink()
    with pytest.raises(UsageError, match=r"^--resume: .*step-00000004.optim-rank1.pt is missing"):
        ckpt.optimizer_state(path, loaded, zero1=True, world_size=2, rank=1)


def test_the_optimizer_layout_must_be_the_runs(tmp_path):
    plain = ckpt.save(tmp_path, 1, state(1), keep_last=3)
    loaded = ckpt.load(plain)
    assert ckpt.optimizer_state(plain, loaded, zero1=False, world_size=2, rank=1) is loaded["optimizer"]
    with pytest.raises(UsageError, match=rf"^{plain} was saved without --zero1: resume it the same way \(the "
                                         r"optimizer state layout differs\)$"):
        ckpt.optimizer_state(plain, loaded, zero1=True, world_size=1, rank=0)
    with pytest.raises(UsageError, match=r"was saved with --zero1 on 2 ranks: resume it the same way"):
        ckpt.check_optimizer_layout(plain, 2, zero1=False, world_size=2)
    with pytest.raises(UsageError, match=r"holds ZeRO-1 optimizer shards of 2 ranks, this run has 4: resume with "
                                         r"torchrun --standalone --nproc_per_node=2$"):
        ckpt.check_optimizer_layout(plain, 2, zero1=True, world_size=4)
    ckpt.check_optimizer_layout(plain, 2, zero1=True, world_size=2)


def test_a_failed_save_removes_its_temporary_files_and_names_the_last_good_one(tmp_path, monkeypatch):
    good = ckpt.save(tmp_path, 2, state(2), keep_last=3)

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.os, "fsync", disk_full)
    with pytest.raises(RunError) as err:
        ckpt.save(tmp_path, 4, state(4), keep_last=3)
    msg = str(err.value)
    free = float(msg.split(" (")[1].split(" MiB")[0])
    assert abs(free - ckpt.shutil.disk_usage(tmp_path).free / 2**20) < 64  # the device's free space, in MiB
    assert msg.startswith(f"no space left on {ckpt.checkpoint_dir(tmp_path)} (")
    assert msg.endswith(f"MiB free): step-00000004.pt was not saved; the last good checkpoint is {good}; "
                        "free some space, then continue with --resume")
    assert names(tmp_path) == ["step-00000002.pt", "step-00000002.pt.sha256"]

    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(RunError, match=rf"^cannot write .*step-00000004.pt: I/O error: step-00000004.pt was not "
                                       rf"saved; the last good checkpoint is {good}$"):
        ckpt.save(tmp_path, 4, state(4), keep_last=3)
    assert names(tmp_path) == ["step-00000002.pt", "step-00000002.pt.sha256"]


def test_a_first_save_that_fails_says_no_checkpoint_was_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(RunError, match=r"I/O error: step-00000000.pt was not saved; no checkpoint was saved before$"):
        ckpt.save(tmp_path, 0, state(0), keep_last=3)
    assert names(tmp_path) == []


def test_an_interrupt_mid_save_leaves_no_temporary_file_and_is_not_swallowed(tmp_path, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, 4, state(4), keep_last=3)
    assert names(tmp_path) == []


def test_the_os_error_behind_torchs_writer_error_is_found():
    cause = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise cause
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed") from None
    except RuntimeError as exc:
        wrapped = exc
    assert ckpt._os_error(cause) is cause
    assert ckpt._os_error(wrapped) is cause
    assert ckpt._os_error(RuntimeError("other")) is None
    assert ckpt._os_error(ValueError("x")) is None
    try:
        try:
            raise cause
        except OSError:
            raise KeyboardInterrupt from None  # an interrupt during a failed write stays an interrupt
    except KeyboardInterrupt as exc:
        assert ckpt._os_error(exc) is None


# ----- cleaning after a killed save ----------------------------------------------------------------------


def test_the_leftovers_of_a_killed_save_are_removed_and_nothing_else(tmp_path):
    ckpt.save(tmp_path, 2, state(2), keep_last=3)
    d = ckpt.checkpoint_dir(tmp_path)
    leftovers = [d / ".step-00000004.pt.tmp-host-123", d / ".step-00000004.pt.sha256.tmp-host-123",
                 d / ".step-00000004.optim-rank1.pt.tmp-9", d / "step-00000004.pt.sha256",
                 tmp_path / ".metrics.jsonl.abc123.tmp"]
    keep = [d / "notes.txt", d / "step-00000002.pt", d / "step-00000002.pt.sha256", tmp_path / "metrics.jsonl",
            d / ".step-00000004.pt.tmp-host-abc", tmp_path / ".notes.txt.tmp", tmp_path / ".thesis.tex.abc123.tmp"]
    for p in leftovers + keep:
        if not p.exists():
            p.write_bytes(b"x")
    assert sorted(ckpt.remove_stale_temps(tmp_path)) == sorted(leftovers)
    assert all(p.exists() for p in keep) and not any(p.exists() for p in leftovers)


def test_cleaning_a_run_without_checkpoints_is_nothing(tmp_path):
    assert ckpt.remove_stale_temps(tmp_path) == []


# ----- loading: one line for every file that is not a whole checkpoint of ours -----------------------------


def test_resume_latest_is_the_newest_checkpoint_and_a_file_must_exist(tmp_path):
    with pytest.raises(UsageError, match=r"^--resume: no checkpoint in .*checkpoints \(pass --output-dir of the run "
                                         r"to resume, or --resume FILE\)$"):
        ckpt.resolve(tmp_path, "latest")
    for step in (8, 9, 10):
        ckpt.save(tmp_path, step, state(step), keep_last=5)
    (ckpt.checkpoint_dir(tmp_path) / "step-11.pt").write_bytes(b"x")  # not our name: ignored
    assert ckpt.resolve(tmp_path, "latest") == ckpt.checkpoint_dir(tmp_path) / "step-00000010.pt"
    assert ckpt.resolve(tmp_path, str(tmp_path / "checkpoints" / "step-00000009.pt")).name == "step-00000009.pt"
    with pytest.raises(UsageError, match=r"^--resume: no such checkpoint file: .*nope.pt$"):
        ckpt.resolve(tmp_path, str(tmp_path / "nope.pt"))


@pytest.mark.parametrize("content, why", [
    (b"", "the file is empty (0 bytes)"),
    (b"hello, not a checkpoint", "not a checkpoint or state dict (not a file written by torch.save)"),
    (b"PK\x03\x04" + b"\x00" * 64, "truncated (68 bytes): the archive ends before its index"),
])
def test_a_file_that_is_not_a_checkpoint_is_one_line(tmp_path, content, why):
    path = tmp_path / "step-00000001.pt"
    path.write_bytes(content)
    with pytest.raises(UsageError) as err:
        ckpt.load(path)
    assert str(err.value) == f"cannot load checkpoint {path}: {why}" or str(err.value).startswith(
        f"cannot load checkpoint {path}: {why}")


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "x": os.getcwd}, path)  # a function: loading it would call code
    with pytest.raises(UsageError, match=r"holds Python objects, not only tensors \(.*\): refused, loading it "
                                         r"could run code$"):
        ckpt.load(path)


def test_a_damaged_file_in_the_old_torch_format_says_so(tmp_path):
    path = tmp_path / "old.pt"
    with open(path, "wb") as fh:
        torch.save({"w": torch.zeros(2)}, fh, _use_new_zipfile_serialization=False)
    checksum_file(path).write_text("0" * 64 + "  old.pt\n")  # changed after it was written: the checksum says so
    with pytest.raises(UsageError) as err:
        ckpt.load(path)
    assert str(err.value) == (f"cannot load checkpoint {path}: a damaged file in the old torch.save format: its "
                              "SHA-256 differs from the one saved with it in old.pt.sha256: the file changed after it "
                              "was written (damaged on disk or in a copy)")
    checksum_file(path).unlink()
    path.write_bytes(path.read_bytes()[:40])  # cut short, no checksum: torch's own error is the reason
    with pytest.raises(UsageError, match=r"^cannot load checkpoint .*old.pt: a damaged file in the old torch.save "
                                         r"format: EOFError$"):
        ckpt.load(path)


def test_a_checkpoint_that_is_not_a_regular_file_is_one_line(tmp_path):
    path = tmp_path / "step-00000001.pt"
    path.mkdir()  # not a file, with a checksum beside it: refused before it is hashed
    checksum_file(path).write_text("0" * 64 + "  step-00000001.pt\n")
    with pytest.raises(UsageError, match=rf"^cannot load checkpoint {path} is a directory, not a regular file"):
        ckpt.load(path)


def test_changed_bytes_are_found_by_the_checksum_before_loading(tmp_path):
    path = ckpt.save(tmp_path, 3, state(3), keep_last=3)
    checksum_file(path).write_text("0" * 64 + "  step-00000003.pt\n")
    with pytest.raises(UsageError, match=r"^cannot load checkpoint .*step-00000003.pt: its SHA-256 differs"):
        ckpt.load(path)


def test_a_state_dict_that_is_not_ours_is_refused_naming_pretrained(tmp_path):
    for i, content in enumerate(({"w": torch.zeros(2)}, {"format": 2}, [1, 2])):
        path = tmp_path / f"other{i}.pt"
        torch.save(content, path)
        with pytest.raises(UsageError, match=rf"^{path} is not a neuron_train checkpoint \(format 1\): "
                                             r"to start from its weights, pass it as --pretrained instead of "
                                             r"--resume$"):
            ckpt.load(path)


def test_inspect_reads_what_the_checkpoint_says_about_its_run(tmp_path):
    path = ckpt.save(tmp_path, 6, state(6), keep_last=3)
    info = ckpt.inspect(path)
    assert (info.step, info.global_batch, info.world_size, info.model, info.img_size, info.batch_size,
            info.grad_accum, info.zero1_ranks, info.seed) == (6, 16, 2, "vit-nano", 32, 4, 2, None, 7)
    sharded = ckpt.save(tmp_path, 7, state(7, optimizer=ckpt.sharded_marker(2),
                                           config={**CONFIG, "train": {"batch_size": 4, "grad_accum": 2}}), 3)
    info = ckpt.inspect(sharded)
    assert (info.zero1_ranks, info.seed) == (2, None)
    assert type(info.world_size) is int  # shown as "2 ranks", never "2.0"
    odd = ckpt.save(tmp_path, 8, state(8, config={**CONFIG, "train": {"batch_size": 4, "grad_accum": 2,
                                                                       "seed": "7"}}), 3)
    assert ckpt.inspect(odd).seed is None  # a seed that is not a number is not shown as one


def test_the_newest_good_checkpoint_is_found_past_damaged_ones_with_one_line_each(tmp_path):
    assert ckpt.newest_good(tmp_path) == (None, [])
    for step in (2, 4, 6):
        ckpt.save(tmp_path, step, state(step), keep_last=5)
    d = ckpt.checkpoint_dir(tmp_path)
    (d / "step-00000006.pt").write_bytes((d / "step-00000006.pt").read_bytes()[:100])  # cut short
    torch.save({"format": 1}, d / "step-00000004.pt")  # loads, but holds nothing to resume
    checksum_file(d / "step-00000004.pt").unlink()
    info, skipped = ckpt.newest_good(tmp_path)
    assert info.path == d / "step-00000002.pt" and info.step == 2
    assert skipped == [
        f"cannot load checkpoint {d / 'step-00000006.pt'}: truncated (100 bytes): the archive ends before its index "
        "(an interrupted save or copy)",
        f"{d / 'step-00000004.pt'} cannot be resumed: it has no 'model', 'optimizer', 'position', 'rng', "
        "'global_batch', 'config' entries (a damaged file, or not saved by neuron_train)"]
    with pytest.raises(UsageError, match=rf"^{d / 'step-00000004.pt'} cannot be resumed: it has no 'model'"):
        ckpt.load_resumable(d / "step-00000004.pt")
    torch.save([1], d / "step-00000004.pt")
    assert ckpt.newest_good(tmp_path)[1][1] == (f"{d / 'step-00000004.pt'} is not a neuron_train checkpoint "
                                               "(format 1): to start from its weights, pass it as --pretrained "
                                               "instead of --resume")


# ----- which model a file is from ---------------------------------------------------------------------------


def test_a_model_mismatch_is_one_line_naming_the_files_model():
    model = torch.nn.Linear(3, 2)
    saved = {"model": {"weight": torch.zeros(2, 4), "extra1": torch.zeros(1), "extra2": torch.zeros(1),
                       "extra3": torch.zeros(1)}, "config": CONFIG}
    with pytest.raises(UsageError) as err:
        ckpt.load_model_state(model, saved, "f.pt")
    assert str(err.value) == (
        "f.pt does not fit this model: 1 missing (bias), 3 unknown (extra1, extra2, ...), 1 of another shape "
        "(weight: [2, 4] in the file, [2, 3] in the model) weights; it is from model vit-nano (--img-size 32): "
        "resume with the same --model, --img-size and classes")
    assert fmt.describe_mismatch(model.state_dict(), model.state_dict()) is None
    assert fmt.origin({"w": 1}) == "a file without neuron_train metadata (model unknown)"
    assert fmt.origin([1, 2]) == "a file without neuron_train metadata (model unknown)"  # not even a dict
    two = {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2), "extra1": torch.zeros(1),
                     "extra2": torch.zeros(1)}}
    assert fmt.describe_mismatch(two["model"], model.state_dict()) == "2 unknown (extra1, extra2)"
    ckpt.load_model_state(model, {"model": {k: v + 1 for k, v in model.state_dict().items()}}, "f.pt")


def test_the_rng_states_saved_are_the_ones_a_resume_restores():
    """torch's, Python's and the XLA seed: restored, the next draws are the ones after the save."""
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(1234)
    saved = ckpt.rng_state()
    assert structure_problem({**state(1), "rng": saved}) is None
    after_save = (torch.rand(3), random.random(), xm.get_rng_state())
    torch.rand(5), random.random(), xm.set_rng_state(99)  # the run goes on, then stops
    ckpt.set_rng_state({**saved, "python": list(saved["python"])})
    assert torch.equal(torch.rand(3), after_save[0]) and random.random() == after_save[1]
    assert xm.get_rng_state() == after_save[2] == 1234


def test_a_damaged_rng_state_is_one_line(tmp_path):
    bad = {"torch": torch.zeros(3, dtype=torch.uint8), "python": random.getstate(), "xla": 0}
    with pytest.raises(UsageError, match=r"^the checkpoint's RNG state is damaged \(Expected a CPUGeneratorImplState "
                                         r"of size \d+ but found the input RNG state size to be 3\): "
                                         r"resume from another"):
        ckpt.set_rng_state(bad)


def test_the_state_is_copied_to_the_host_whole_and_detached():
    w = torch.ones(2, requires_grad=True) * 2
    state = {"model": {"w": w}, "step": 3, "groups": [{"lr": 0.1, "t": torch.zeros(1)}]}
    host = ckpt.to_cpu(state)
    assert host["step"] == 3 and host["groups"][0]["lr"] == 0.1 and torch.equal(host["groups"][0]["t"], torch.zeros(1))
    assert torch.equal(host["model"]["w"], torch.full((2,), 2.0)) and not host["model"]["w"].requires_grad


def test_pythons_random_state_read_back_as_lists_is_a_tuple_again():
    state = random.getstate()
    as_lists = [state[0], list(state[1]), state[2]]
    assert ckpt._as_tuple(as_lists) == state and ckpt._as_tuple(5) == 5


def test_a_zip_archive_that_torch_cannot_read_is_one_line_with_the_reason(tmp_path):
    path = tmp_path / "step-00000001.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "not a torch.save archive")
    with pytest.raises(UsageError) as err:
        ckpt.load(path)
    assert str(err.value).startswith(f"cannot load checkpoint {path}: a damaged torch.save archive: ")
    assert len(str(err.value)) > len(f"cannot load checkpoint {path}: a damaged torch.save archive: ") + 5


# ----- what a save leaves for the user and for the cleanup ------------------------------------------------------


def test_the_checksum_beside_a_checkpoint_is_a_sha256sum_line_of_its_bytes(tmp_path):
    """`sha256sum -c step-N.pt.sha256` in the checkpoints folder verifies it (docs/reliability.md)."""
    path = ckpt.save(tmp_path, 2, state(2), keep_last=3)
    assert checksum_file(path).read_text() == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  step-00000002.pt\n"


def test_a_save_makes_the_folders_it_needs(tmp_path):
    run_dir = tmp_path / "new" / "run"
    assert ckpt.save(run_dir, 2, state(2), keep_last=3).is_file()


def test_a_save_at_a_negative_step_is_refused():
    with pytest.raises(RunError, match=r"^cannot save a checkpoint at step -1: steps are >= 0$"):
        ckpt.save(Path("unused"), -1, state(0), keep_last=3)


def test_the_temporary_files_of_a_save_are_the_ones_the_cleanup_removes(tmp_path, monkeypatch):
    """What a save writes before its final names, left behind by a kill, is found at the next start."""
    seen: set[str] = set()
    real = ckpt.fmt.checksum_line

    def looking(data_file, final_name):  # while the checksum is written, both temporary files exist
        seen.update(p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir())
        return real(data_file, final_name)

    monkeypatch.setattr(ckpt.fmt, "checksum_line", looking)
    ckpt.save(tmp_path, 2, state(2), keep_last=3)
    temps = sorted(seen - {"step-00000002.pt", "step-00000002.pt.sha256"})
    assert len(temps) == 2 and all(t.startswith(".step-00000002.pt") for t in temps), temps
    for name in temps:  # as a save killed at that moment leaves them
        (ckpt.checkpoint_dir(tmp_path) / name).write_bytes(b"x")
    assert sorted(p.name for p in ckpt.remove_stale_temps(tmp_path)) == temps
    assert names(tmp_path) == ["step-00000002.pt", "step-00000002.pt.sha256"]


def test_a_save_whose_file_cannot_even_be_created_is_one_line(tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.writer, "create_new", no_space)  # the temporary file
    with pytest.raises(RunError, match=r"^no space left on .*step-00000002.pt was not saved; no checkpoint"):
        ckpt.save(tmp_path, 2, state(2), keep_last=3)


def test_old_checkpoints_and_shards_without_checksums_are_pruned_too(tmp_path):
    """Checkpoints of an older version (no .sha256 beside them) are kept or removed like the others."""
    for step in (2, 4):
        for rank in (0, 1):
            ckpt.save_shard(tmp_path, step, rank, {"state": {}, "param_groups": [], "rank": rank})
        ckpt.save(tmp_path, step, state(step, optimizer=ckpt.sharded_marker(2)), keep_last=3)
    for p in ckpt.checkpoint_dir(tmp_path).glob("step-00000002*.sha256"):
        p.unlink()
    ckpt.save(tmp_path, 6, state(6), keep_last=2)
    assert [n for n in names(tmp_path) if "00000002" in n] == []


# ----- a checkpoint without its checksum -----------------------------------------------------------------


def test_a_checkpoint_without_its_checksum_loads_with_one_note_once_on_rank_0(tmp_path, capsys, monkeypatch):
    path = ckpt.save(tmp_path, 2, state(2), keep_last=3)
    ckpt.load(path)
    assert capsys.readouterr() == ("", "")  # verified: nothing to say
    checksum_file(path).unlink()
    monkeypatch.delenv("RANK", raising=False)
    ckpt.load(path)
    ckpt.load_resumable(path)
    assert capsys.readouterr() == ("", (
        f"note: {path} has no step-00000002.pt.sha256 beside it (saved by an older neuron-train, or copied "
        "without it): loaded without a checksum check; copy the .sha256 file with it to have it verified\n"))
    other = ckpt.save(tmp_path, 4, state(4), keep_last=3)
    checksum_file(other).unlink()
    monkeypatch.setenv("RANK", "1")
    ckpt.load(other)
    assert capsys.readouterr() == ("", "")  # every rank reads it; rank 0 says it
    monkeypatch.setenv("RANK", "0")
    ckpt.load(other)
    assert capsys.readouterr().err.startswith(f"note: {other} has no ")
