"""The one check a compile cache passes before anything compiles into it (precompile/cache_env.py:
check_cache), seen from each command that uses it: precompile and check-graphs --compile-cache
refuse a damaged cache in one line, before the command runs. (`train --compile-cache` goes through
the same function: tests/precompile/test_precompile.py::test_a_damaged_entry_is_never_used_silently.)"""

from __future__ import annotations

import pytest

from neuron_train import cli
from neuron_train.common.errors import RunError
from neuron_train.precompile import store
from neuron_train.precompile.cache_env import check_cache

ENTRY = "xla/0123456789abcdef"


@pytest.fixture
def damaged(tmp_path):
    cache = tmp_path / "cc"
    (cache / "xla").mkdir(parents=True)
    (cache / ENTRY).write_bytes(b"x" * 100)
    store.update_manifest(cache, lambda m: m.files.__setitem__(ENTRY, store.file_record(cache / ENTRY, "f" * 16)))
    (cache / ENTRY).write_bytes(b"x" * 50)  # truncated after it was recorded
    return cache


def test_check_cache_refuses_a_damaged_entry_and_names_the_fix(damaged):
    with pytest.raises(RunError) as exc:
        check_cache(damaged, store.load_manifest(damaged))
    message = str(exc.value)
    assert "1 damaged file(s)" in message and ENTRY in message
    assert f"neuron-train cache verify --compile-cache {damaged} --quarantine" in message


def test_check_cache_returns_the_recorded_files_that_are_gone(damaged):
    (damaged / ENTRY).unlink()
    assert [f.entry for f in check_cache(damaged, store.load_manifest(damaged))] == [ENTRY]


@pytest.mark.parametrize("argv", [
    ["precompile", "--target", "cpu", "--compile-cache", "{cache}", "--", "python", "-c", "pass"],
    ["check-graphs", "--compile-cache", "{cache}", "--", "python", "-c", "pass"],
])
def test_each_command_refuses_a_damaged_cache_before_it_runs(damaged, argv, capsys):
    code = cli.main([a.format(cache=damaged) for a in argv])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    lines = err.strip().splitlines() or [""]
    assert lines[-1].startswith(f"neuron-train {argv[0]}: compile cache {damaged} has 1 damaged file(s)")
    assert "Traceback" not in err
