"""The one reader for every file a command takes (config YAML/TOML, prices, bench and plan results,
calibration, manifests, checksum sidecars, CSV tables): bounded, then parsed, then checked.

- Regular files only: a FIFO, a device or a directory is refused from its `stat` before it is opened,
  and the file is opened with O_NONBLOCK and checked again with `fstat` (a FIFO swapped in between
  never blocks the open). No read waits on a writer; no read is unbounded.
- A size bound (`limit`, default 16 MiB: every real input is far smaller) checked before a byte is read.
- Parsed documents are bounded too: nesting at most `MAX_DEPTH` levels, integers of at most
  `MAX_INT_DIGITS` digits (a 400-digit `lr` is refused here, not as an OverflowError later), and
  YAML aliases (`*name`) refused before anything is expanded (a 1 KB alias bomb is megabytes of
  values). YAML reads numbers as YAML 1.2 does: `lr: 1e-3` is a float, not the string '1e-3';
  `010000` is 10000, not octal 4096. A key given twice in a YAML mapping or a JSON object is
  refused, as TOML refuses it.
- What the parser took but later code cannot use is refused naming the field: a float that is not
  0 and not between 1e-100 and 1e100 in size (`values.out_of_range`: its arithmetic stays finite),
  text that does not encode as UTF-8 (a lone surrogate) or holds NUL.
- Every refusal is one `UsageError` line naming the option (or file) and quoting at most a bounded
  prefix of a value (`values.shown`). Validation into the typed record the code uses is the
  caller's next step (`values.kind_problem` tables, the config's dataclasses, `records.py` models).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import tomllib
import yaml

from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import not_utf8, unusable_path
from neuron_train.common.values import out_of_range, plain, range_problem, shown

DEFAULT_LIMIT = 16 * 2**20
MAX_DEPTH = 64          # levels of nesting; real inputs have fewer than 10
MAX_INT_DIGITS = 19     # |n| < 10**19 covers every int64; larger integers are no value any field takes

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((text for test, text in _KINDS if test(mode)), "not a regular file")


def _where(path: Path, flag: str) -> str:
    text = str(path) if len(str(path)) <= 160 else shown(str(path), 160)
    return f"{flag}: {text}" if flag else text


def regular_file(path: str | os.PathLike, flag: str = "") -> os.stat_result:
    """`stat` of `path` (links followed), refused in one line unless it is a regular file."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{flag + ': ' if flag else ''}no such file: {_where(path, '')}") from None
    except OSError as exc:
        raise unusable_path(exc, flag) or UsageError(f"{_where(path, flag)}: cannot read it "
                                                     f"({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{_where(path, flag)} is {_kind(st.st_mode)}, not a regular file: give a file")
    return st


def read_bytes(path: str | os.PathLike, flag: str = "", limit: int = DEFAULT_LIMIT) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; anything else is one UsageError line."""
    path = Path(path)
    regular_file(path, flag)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise unusable_path(exc, flag) or UsageError(f"{_where(path, flag)}: cannot read it "
                                                     f"({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)  # what was opened, not what was stat'ed: it may have been swapped meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{_where(path, flag)} is {_kind(st.st_mode)}, not a regular file: give a file")
        if st.st_size > limit:
            raise UsageError(f"{_where(path, flag)} is {st.st_size:,} bytes, more than any such file "
                             f"({limit:,}): give the right file")
        chunks, total = [], 0
        while total <= limit:  # a file growing while read is still bounded
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise UsageError(f"{_where(path, flag)}: cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if total > limit:
        raise UsageError(f"{_where(path, flag)} grew past {limit:,} bytes while read: give a finished file")
    return b"".join(chunks)


def read_text(path: str | os.PathLike, flag: str = "", limit: int = DEFAULT_LIMIT) -> str:
    """`read_bytes` decoded as UTF-8 (a byte-order mark is dropped); not UTF-8 is one line naming the byte."""
    data = read_bytes(path, flag, limit)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise not_utf8(Path(path), exc) from None


# ----------------------------------------------------------------------------- parsing


class _Refused(Exception):
    """A document beyond the bounds (raised inside a parser, said as one line by `parse`)."""


# YAML 1.1 (PyYAML) reads 1e-3 as a string: it wants a dot. YAML 1.2, and everyone writing a
# learning rate, mean a float.
_FLOAT_12 = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


# YAML 1.1 (PyYAML) reads `010000` as octal 4096 and `1:20` as 80; YAML 1.2 writes octal `0o10000`.
_INT_12 = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$")
_INT_TAG = "tag:yaml.org,2002:int"


class _BoundedLoader(yaml.SafeLoader):
    """safe_load without aliases (refused before they are expanded), at most MAX_DEPTH levels, no
    key twice in a mapping (TOML refuses it; YAML 1.1 keeps the last silently)."""

    _depth = 0

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and (key_node.tag, key) in seen:
                raise _Refused(f"line {key_node.start_mark.line + 1}: the key {shown(key, 40)} is given twice: "
                               "keep one (TOML refuses it too)")
            seen.add((key_node.tag, key))
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
        base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
        return sign * int(digits[2:] if base != 10 else digits, base)  # `010000` is 10000

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise _Refused(f"line {mark.line + 1}: a YAML alias (*name) is not accepted: write the value out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nested too deeply (more than {MAX_DEPTH} levels; no real file has)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
_BoundedLoader.yaml_implicit_resolvers = {  # YAML 1.2's integers where 1.1's were, before _FLOAT_12
    first: [(tag, _INT_12 if tag == _INT_TAG else regex) for tag, regex in resolvers]
    for first, resolvers in _BoundedLoader.yaml_implicit_resolvers.items()}
_BoundedLoader.add_constructor(_INT_TAG, _BoundedLoader.construct_yaml_int)


_Trail = tuple  # (parent trail, key or index): the path to a node, spelled out only for a message


def _spelled(trail: _Trail | None) -> str:
    parts: list[str] = []
    while trail:
        trail, step = trail
        parts.append(f"[{step}]" if isinstance(step, int) else f".{plain(step, 40)}")
    return "".join(reversed(parts)).lstrip(".") or "a value"


def _check_tree(value: object) -> None:
    """Depth, integer, float and text bounds of a parsed document, walked without recursion."""
    stack: list[tuple[object, int, _Trail | None, str]] = [(value, 1, None, "")]
    while stack:
        node, depth, trail, role = stack.pop()
        if depth > MAX_DEPTH:
            raise _Refused(f"nested too deeply (more than {MAX_DEPTH} levels; no real file has)")
        if isinstance(node, dict):
            stack += [(v, depth + 1, (trail, k), "") for k, v in node.items()]
            stack += [(k, depth + 1, trail, "a key: ") for k in node]
        elif isinstance(node, (list, tuple)):
            stack += [(v, depth + 1, (trail, i), "") for i, v in enumerate(node)]
        else:
            problem = _leaf_problem(node)
            if problem:
                raise _Refused(f"{_spelled(trail) if trail else 'the top level'}: {role}{problem}")


def _leaf_problem(node: object) -> str | None:
    """What makes a value unusable later although the parser took it: an integer no field takes,
    a float whose arithmetic would overflow (a price of 1e-320 made a report's axis NaN), text that
    is not UTF-8 (a lone surrogate from a JSON or YAML escape) or holds NUL (no name, label or path can)."""
    if isinstance(node, bool):
        return None
    if isinstance(node, int) and abs(node) >= 10**MAX_INT_DIGITS:
        return f"an integer of {len(str(abs(node)))} digits is not a value any field takes"
    if isinstance(node, float) and out_of_range(node):
        return range_problem(node)
    if isinstance(node, str):
        if "\0" in node:
            return f"{shown(node, 40)} holds a NUL character (\\0): no name, label or path can; remove it"
        try:
            node.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"{shown(node, 40)} is not valid Unicode (a lone surrogate {node[exc.start]!a} at character "
                    f"{exc.start + 1}): write the text itself, not a \\u escape of half a pair")
    return None


def _json_object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object with no key twice (json keeps the last silently; TOML refuses it)."""
    data: dict[str, object] = {}
    for key, value in pairs:
        if key in data:
            raise _Refused(f"the key {shown(key, 40)} is given twice in one object: keep one")
        data[key] = value
    return data


def parse(text: str, fmt: str, where: str) -> object:
    """`text` parsed as `fmt` ("json", "yaml" or "toml") within the bounds; one UsageError line if not."""
    try:
        if fmt == "json":
            data = json.loads(text, object_pairs_hook=_json_object)
        elif fmt == "yaml":
            data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
        else:
            data = tomllib.loads(text)
        _check_tree(data)
    except _Refused as exc:
        raise UsageError(f"{where}: {exc}") from None
    except RecursionError:  # JSON or TOML nested thousands of levels deep
        raise UsageError(f"{where}: nested too deeply (more than {MAX_DEPTH} levels; no real file has)") from None
    except (json.JSONDecodeError, yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"{where} is not valid {fmt.upper()}: {first[:200]}") from None
    except ValueError as exc:  # an integer of more than 4300 digits (Python's own bound)
        raise UsageError(f"{where} is not valid {fmt.upper()}: {str(exc)[:200]}") from None
    return data


def load(path: str | os.PathLike, flag: str = "", fmt: str = "", limit: int = DEFAULT_LIMIT) -> object:
    """A JSON, YAML or TOML file (`fmt`, else from its suffix: .json, .yaml/.yml, .toml), read
    and parsed within the bounds. The caller validates what it holds."""
    path = Path(path)
    regular_file(path, flag)  # an unusable path is said first, whatever its suffix
    fmt = fmt or {".json": "json", ".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}.get(path.suffix.lower(), "")
    if not fmt:
        raise UsageError(f"{_where(path, flag)}: use a .json, .yaml, .yml or .toml file")
    return parse(read_text(path, flag, limit), fmt, _where(path, flag))
