"""Every command that opens a compile-cache folder goes through `store.open_cache`: an S3 URL given as
the folder is refused by each with the same line (naming `cache unpack`, which brings an S3 archive
into a folder) and exit 2, before anything is created or run."""

from __future__ import annotations

import pytest

from neuron_train import cli
from neuron_train.common.errors import UsageError
from neuron_train.precompile.store import open_cache
from neuron_train.training.cache_hook import point_compiler_at_cache

URL = "s3://bucket/caches/warm"
REFUSAL = (f"neuron-train {{command}}: error: --compile-cache must be a local folder, not {URL}: bring an S3 "
           "archive into one with `neuron-train cache unpack s3://BUCKET/KEY --compile-cache DIR`\n")

# argv after the command name; {url} is the S3 location, {tmp} a scratch folder
DOORS = {
    "train": ["--output-dir", "{tmp}/run", "--model", "vit-nano", "--compile-cache", "{url}"],
    "precompile": ["--dry-run", "--compile-cache", "{url}", "--", "--model", "vit-nano"],
    "precompile-in-train-args": ["--dry-run", "--", "--model", "vit-nano", "--compile-cache", "{url}"],
    "precompile-script": ["--dry-run", "--compile-cache", "{url}", "--", "python", "my_train.py"],
    "check-graphs": ["--compile-cache", "{url}", "--", "python", "my_train.py"],
    "cache-list": ["list", "--compile-cache", "{url}"],
    "cache-verify": ["verify", "--compile-cache", "{url}"],
    "cache-prune": ["prune", "--compile-cache", "{url}", "--failed"],
    "cache-pack": ["pack", "--compile-cache", "{url}", "{tmp}/warm.tar.gz"],
    "cache-unpack": ["unpack", "--compile-cache", "{url}", "{tmp}/warm.tar.gz"],
}


@pytest.mark.parametrize("door", sorted(DOORS))
def test_each_door_refuses_an_s3_folder_with_the_same_line_and_exit_2(door, tmp_path, capsys, in_process_cli,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "warm.tar.gz").write_bytes(b"not read")
    command = door.split("-")[0] if door.startswith(("cache", "precompile")) else door
    argv = [a.format(url=URL, tmp=tmp_path) for a in DOORS[door]]
    before = sorted(tmp_path.rglob("*"))
    assert cli.main([command, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err == REFUSAL.format(command=command)
    assert sorted(tmp_path.rglob("*")) == before  # nothing created: no run folder, no cache, no archive


def test_the_training_hook_and_the_door_refuse_with_the_same_words():
    with pytest.raises(UsageError) as door:
        open_cache(URL)
    with pytest.raises(UsageError) as hook:
        point_compiler_at_cache(URL)  # train's and the loop's cache hook
    assert str(door.value) == str(hook.value) == REFUSAL.split(": error: ", 1)[1].rstrip("\n")


def test_a_local_folder_passes_the_door_unchanged(tmp_path):
    assert open_cache(str(tmp_path / "cc")) == tmp_path / "cc"
    assert open_cache("local/s3://b") == __import__("pathlib").Path("local/s3://b")  # only the scheme counts
