"""No module writes around the writer (common/writer.py), as test_architecture guards imports:
every call that creates, replaces, appends to or deletes a file or folder is found in the source
(no import executed) and must be in the writer's own modules, or in a module listed in `NOT_YET`
with its number of such calls (code not yet moved to the writer: docs/reliability.md says what it
is). A new write anywhere else, or one more in a listed module, fails; one fewer asks for the list
to shrink. A planted violation checks that the test can fail."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "neuron_train"
WRITER = {"neuron_train.common.writer", "neuron_train.common.fileio"}  # the door, and what it builds on
MODULE_CALLS = {("os", n) for n in ("replace", "rename", "renames", "unlink", "remove", "rmdir", "removedirs",
                                     "link", "symlink", "mkfifo", "mknod", "mkdir", "makedirs", "truncate")}
MODULE_CALLS |= {("shutil", n) for n in ("rmtree", "move", "copy", "copy2", "copyfile", "copytree")}
PATH_METHODS = {"unlink", "rmdir", "write_text", "write_bytes", "symlink_to", "hardlink_to", "touch", "mkdir",
                "rename"}
WRITE_FLAGS = {"O_CREAT", "O_WRONLY", "O_RDWR", "O_APPEND", "O_TRUNC"}

# module -> writes not yet moved to the writer (each a temporary or private folder of our own, or a
# file already written under a name only this process uses); docs/reliability.md, "Not covered yet"
NOT_YET = Counter({
    "neuron_train.commands.precompile": 1,        # the cache folder the user named, created
    "neuron_train.graphs.recorder": 4,            # records in the checker's own temporary folder
    "neuron_train.instrument.marker": 1,          # the same folder
    "neuron_train.instrument.probe": 3,           # the probe's own temporary folder
    "neuron_train.precompile.archive": 4,         # unpack: its work folder (`work_path`) and moves into the cache
    "neuron_train.precompile.maintenance": 1,     # quarantine's move (into folders made by make_folders)
    "neuron_train.precompile.script_check": 1,    # the coverage file in check-graphs' temporary folder
    "neuron_train.precompile.script_precompile": 1,  # its staging folder, under the cache
    "neuron_train.precompile.store": 5,           # the cache folder, the commit of staged files
    "neuron_train.training.cache_hook": 2,        # the cache folder and its staging folder
    "neuron_train.training.checkpoint": 1,        # the run folder (the user's --output-dir), created
    "neuron_train.training.profiler": 1,          # the trace folder in the run
    "neuron_train.training.rundir": 3,            # the run folder, attempt-N/ and the moves into it
})


def _writes_open(call: ast.Call) -> bool:
    """builtin open() with a mode that writes, or os.open() with a flag that writes."""
    func = call.func
    if isinstance(func, ast.Name) and func.id == "open":
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and bool(set(mode.value) & set("wax+"))
    if isinstance(func, ast.Attribute) and func.attr == "open" and isinstance(func.value, ast.Name) \
            and func.value.id == "os" and len(call.args) > 1:
        return any(isinstance(n, ast.Attribute) and n.attr in WRITE_FLAGS for n in ast.walk(call.args[1]))
    return False


def writes_in(source: str) -> list[int]:
    """Line numbers of the calls in `source` that write to the file system."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if (owner, func.attr) in MODULE_CALLS or (owner not in ("os", "shutil", "str", "re")
                                                     and func.attr in PATH_METHODS and _path_like(func)):
                found.append(node.lineno)
                continue
        if _writes_open(node):
            found.append(node.lineno)
    return found


def _path_like(func: ast.Attribute) -> bool:
    """`x.rename(...)` / `x.unlink()` on anything but a string literal (str has neither)."""
    return not (isinstance(func.value, ast.Constant) and isinstance(func.value.value, str))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def counts(files: dict[str, str]) -> Counter:
    return Counter({name: len(writes_in(src)) for name, src in files.items()
                    if name not in WRITER and writes_in(src)})


def sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_no_module_writes_around_the_writer():
    found = counts(sources())
    extra = {m: n for m, n in found.items() if n > NOT_YET[m]}
    assert extra == {}, f"writes outside common/writer.py (route them through it): {extra}"
    fewer = {m: (NOT_YET[m], found[m]) for m in NOT_YET if found[m] < NOT_YET[m]}
    assert fewer == {}, f"fewer writes than NOT_YET lists: lower it: {fewer}"


@pytest.mark.parametrize("planted", [
    "import os\nos.replace('a', 'b')",
    "import shutil\nshutil.rmtree(folder)",
    "path.write_text('x')",
    "(run / '.lock').unlink()",
    "open(path, 'a').write('x')",
    "open(path, mode='wb')",
    "import os\nfd = os.open(p, os.O_WRONLY | os.O_CREAT)",
    "Path(p).mkdir(parents=True)",
])
def test_a_planted_write_around_the_writer_is_found(planted):
    files = {**sources(), "neuron_train.training.planted": planted}
    assert counts(files)["neuron_train.training.planted"] == 1


@pytest.mark.parametrize("harmless", ["open(path)", "open(path, 'rb')", "'a-b'.replace('-', '_')",
                                      "import os\nos.open(p, os.O_RDONLY)", "name.replace('x', 'y')"])
def test_reads_and_string_methods_are_not_writes(harmless):
    assert writes_in(harmless) == []
