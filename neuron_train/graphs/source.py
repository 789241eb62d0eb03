"""The Python statement behind a line of the user's script (its source, parsed with `ast`): the branch
that chose which graph a step traced, the slice that made an input's shape."""

from __future__ import annotations

import ast
import functools
import linecache
from collections.abc import Iterator

_JUMPS = (ast.Return, ast.Continue, ast.Break, ast.Raise)


@functools.lru_cache(maxsize=32)
def _tree(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None  # not a file we can read (a notebook cell, <string>, a deleted script)


def _split(where: str) -> tuple[str, int]:
    path, _, line = where.rpartition(":")
    return path, int(line) if line.isdigit() else 0


def _blocks(tree: ast.AST) -> Iterator[tuple[ast.AST, list[ast.stmt]]]:
    """Every statement list in the tree (bodies, else branches, handlers)."""
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield node, block


def _holds(stmt: ast.stmt, line: int) -> bool:
    return stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno)


def branch_at(where: str, sync: str = "") -> str:
    """`file:line` of the Python `if` that chose the ops traced at `where` ("" when none): the innermost
    `if` whose body or else holds that line, or an `if` right before its statement whose body leaves
    (return, continue, break: the code after it runs on one path only), or else an `if` in a loop that
    holds the sync that ran the graph (`sync`: how many iterations one graph holds, e.g. an
    accumulation remainder)."""
    path, line = _split(where)
    tree = _tree(path) if line else None
    if tree is None:
        return ""
    found = 0
    for node, block in _blocks(tree):
        for i, stmt in enumerate(block):
            if not _holds(stmt, line):
                continue
            if isinstance(node, ast.If) and stmt.lineno != node.lineno:
                found = max(found, node.lineno)
            before = block[i - 1] if i else None
            if isinstance(before, ast.If) and isinstance(before.body[-1], _JUMPS):
                found = max(found, before.lineno)
    if found:
        return f"{path}:{found}"
    return _branch_around_sync(tree, path, line, sync) if sync.startswith(f"{path}:") else ""


def _branch_around_sync(tree: ast.Module, path: str, line: int, sync: str) -> str:
    """An `if` holding the sync, inside a loop that also holds the line where the graphs differ."""
    at = _split(sync)[1]
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While)) and _holds(n, at) and _holds(n, line)]
    ifs = [n for loop in loops for n in ast.walk(loop) if isinstance(n, ast.If)
           and any(_holds(s, at) for s in n.body + n.orelse)]
    return f"{path}:{max(n.lineno for n in ifs)}" if ifs else ""


def slice_at(where: str) -> bool:
    """Does the line at `where` cut a tensor with a slice whose bound is computed (`data[:, :seq]`)?"""
    path, line = _split(where)
    # A slice's subscript starts on a line with its `[` or goes on with a `:`; any other line, and most
    # lines the graphs name in a library's big file (transformers' trainer.py, torch's functional.py),
    # is answered without parsing the file (a parse and a walk cost 50-100 ms each)
    text = linecache.getline(path, line) if line else ""
    return ("[" in text or ":" in text) and line in _computed_slice_lines(path)


@functools.lru_cache(maxsize=32)
def _computed_slice_lines(path: str) -> frozenset[int]:
    """Every line of `path` that a slice with a computed bound spans: one walk of the tree per file (a
    library file such as transformers' trainer.py is asked about again at every new graph)."""
    tree = _tree(path)
    lines: set[int] = set()
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Slice) and any(b is not None and not _constant(b)
                                               for b in (node.lower, node.upper, node.step)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return frozenset(lines)


def _constant(node: ast.expr) -> bool:
    """`8`, `-1`: a bound written as a number (the same length every step)."""
    return isinstance(node, ast.Constant) or (isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant))


def key_written(path: str, key: str) -> str:
    """`file:line` of the first statement that writes `key` into a dict by subscript (`g["lr"] = ...`,
    `opt.param_groups[0]["lr"] *= ...`) in the script at `path` ("" when none): the line that sets a
    value a compiled function's guard checks."""
    tree = _tree(path)
    if tree is None:
        return ""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant) \
                    and target.slice.value == key:
                lines.append(node.lineno)
    return f"{path}:{min(lines)}" if lines else ""


def call_of(op: str, where: str) -> str:
    """`file:line` of the call to the Python function behind a CPU fallback op (`aten::_unique2`:
    `torch.unique(...)`, `x.unique(...)`) in the file of `where`, the last one at or before its line (the
    loop's), else the first; "" when that file has none."""
    path, line = _split(where)
    tree = _tree(path) if line else None
    if tree is None:
        return ""
    base = op.rpartition("::")[2].strip("_")
    names = {base, base.rstrip("0123456789")}
    calls = sorted(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        getattr(node.func, "attr", None) in names or getattr(node.func, "id", None) in names))
    before = [n for n in calls if n <= line]
    return f"{path}:{(before or calls)[-1 if before else 0]}" if calls else ""
