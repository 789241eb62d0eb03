"""Field kinds for the JSON files we read back (graph manifests, bench results): a value is checked
against a short kind name, so a file's schema is a table of `field -> kind` and every problem is
reported the same way. Numbers are always finite (JSON readers accept NaN and Infinity).

`header_problem` checks the name and version a file gives itself.

Kinds: "str", "int>=0", "int>=1", "number>=0", "number>0", "str-list", "number-list>0", "object",
"list"; a trailing "?" also accepts null.
"""

from __future__ import annotations

import math
import reprlib

MIN_FLOAT, MAX_FLOAT = 1e-100, 1e100  # a number is 0 or this big: products of three stay finite


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def out_of_range(value: object) -> bool:
    """A finite number whose later arithmetic may overflow (a price of 1e-320 made a report's axis
    NaN): not 0 and not between MIN_FLOAT and MAX_FLOAT in size."""
    return _number(value) and value != 0 and not MIN_FLOAT <= abs(value) <= MAX_FLOAT  # type: ignore[arg-type]


def range_problem(value: object) -> str:
    return (f"{value!r} is not a value any field takes (a number is 0, or between {MIN_FLOAT:g} and "
            f"{MAX_FLOAT:g} in size: its arithmetic must stay finite)")


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_KINDS = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int>=0": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "int>=1": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "number>=0": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "number>0": (lambda v: _number(v) and v > 0, "a finite number > 0"),
    "str-list": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "number-list>0": (lambda v: isinstance(v, list) and all(_number(x) and x > 0 for x in v),
                      "a list of finite numbers > 0"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a list"),
}


def kind_problem(value: object, kind: str) -> str | None:
    """None if `value` is of `kind`, else what it must be ("must be an integer >= 1, got '3'")."""
    if kind.endswith("?") and value is None:
        return None
    test, expected = _KINDS[kind.rstrip("?")]
    if test(value) and not out_of_range(value):
        return None
    if test(value):
        return f"must be {expected}: {range_problem(value)}"
    got = "null" if value is None else shown(value)
    return f"must be {expected}{' or null' if kind.endswith('?') else ''}, got {got}"


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 70, 70, 70
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


def shown(value: object, limit: int = 60) -> str:
    """A value for an error line, cut short (a YAML alias bomb is megabytes of repr, a path can be
    100,000 characters)."""
    if isinstance(value, str):
        text, size = repr(value[:limit + 1]), len(value)
    else:  # a bounded repr: never the whole of a value nested or expanded to gigabytes
        text, size = _REPR.repr(value), None
    if len(text) <= limit and (size is None or size <= limit):
        return text
    return f"{text[:limit]}... ({size} characters)" if size is not None else f"{text[:limit]}..."


def plain(value: object, limit: int = 60) -> str:
    """A name for an error line: itself when it is short printable text, else `shown` (quoted, cut)."""
    if isinstance(value, str) and len(value) <= limit and value.isprintable():
        return value
    return shown(value, limit)


def header_problem(data: object, name_key: str, name: str, version_key: str, version: int) -> str | None:
    """None if `data` is a JSON object naming itself `name` at `version`, else what is wrong."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if data.get(name_key) != name:
        return f"{name_key} is {data.get(name_key)!r}, expected {name!r}"
    if data.get(version_key) != version:
        return f"{version_key} {data.get(version_key)!r} is not supported (this neuron-train reads version {version})"
    return None
