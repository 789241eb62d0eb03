"""Why did a call site compile a second graph? Compare the two graphs' HLO (XLA's text dump).

XLA writes `module_NNNN.<name>.before_optimizations.txt` for every compile when
`XLA_FLAGS=--xla_dump_to=DIR` is set (the dump flags are left out of torch_xla's graph hash). With
torch_xla's IR debug on, every instruction carries the innermost Python frame that created it:

    %p3.12 = s64[8]{0} parameter(3), metadata={op_type="xla__device_data" ... source_file="/tmp/t.py" source_line=10}
    %constant.31 = f32[] constant(0), metadata={op_type="aten__nll_loss" ... source_line=3458}

Three differences explain nearly every recompilation: an input with another shape, a Python
scalar 0 or 1 that became a constant (torch_xla bakes these two values into the graph instead of
passing them as data), or a different program (a slice or loop length, a Python branch).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

NEW_INPUT_SHAPE = "new input shape"
NEW_CONSTANT = "new constant"
GRAPH_STRUCTURE = "graph structure changed"
SLICE_OFFSET = "slice offset"   # the same slice of a device tensor at another offset, baked into the graph
UNKNOWN = "unknown"
PYTHON_SCALAR = "prim__Constant"  # the op type of a Python scalar torch_xla baked in as a constant (0 or 1)

_INSTR = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_OPCODE = re.compile(r"^(?P<opcode>[\w\-]+)\(")
_SOURCE = re.compile(r'source_file="(?P<file>[^"]*)" source_line=(?P<line>\d+)')
_OP_TYPE = re.compile(r'op_type="(?P<op>[^"]*)"')
_LAYOUT = re.compile(r"\{[^{}]*\}")
_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[[0-9,]*\]")
_BOUNDS = re.compile(r"slice=(\{[^{}]*\})")
_SPECIAL = {"0", "-0", "1", "-1"}  # torch lazy IsSpecialScalar: 0 and |x| == 1
# torch_xla op names that say little to a user
_OP_NAMES = {"xla::select": "slice (xla::select)", "xla::device_data": "input"}


@dataclass(frozen=True)
class Instr:
    opcode: str
    shape: str
    op_type: str = ""
    value: str = ""   # a constant's literal
    where: str = ""   # file:line of the Python frame that created it ("" without IR debug)
    index: int = -1   # a parameter's number
    bounds: str = ""  # a slice's `{[10:15], [0:8]}`: offsets torch_xla bakes into the graph

    @property
    def key(self) -> tuple:
        """What makes two instructions the same op (metadata is left out: one graph may lack it)."""
        return (self.opcode, self.shape, self.value, self.bounds)

    @property
    def label(self) -> str:
        op = self.op_type.replace("__", "::") if self.op_type else self.opcode
        op = _OP_NAMES.get(op, op)
        value = f" {self.value}" if self.value else ""
        return f"{op} {self.shape}{value}"


@dataclass
class HloSummary:
    params: list[Instr]   # the entry computation's parameters, by number
    instrs: list[Instr]   # every other instruction, in file order
    outputs: list[str] = field(default_factory=list)  # the entry computation's result shapes

    @property
    def special_constants(self) -> list[Instr]:
        return [i for i in self.instrs if i.opcode == "constant" and i.shape.endswith("[]")
                and i.value in _SPECIAL]


@dataclass
class Explanation:
    cause: str
    detail: str
    where: str = ""   # the user's line when the graphs show it, else ""
    library: str = ""  # file:line of the first differing op when it is a library's (no user line shows)


def summarize_hlo(text: str) -> HloSummary:
    params: list[Instr] = []
    instrs: list[Instr] = []
    outputs: list[str] = []
    in_entry = False
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if line.startswith("}"):
            in_entry = False
            continue
        instr = _parse_instr(line)
        if instr is None:
            continue
        if instr.opcode == "parameter":
            if in_entry:
                params.append(instr)
        else:
            instrs.append(instr)
        if in_entry and line.lstrip().startswith("ROOT "):
            outputs = _SHAPE.findall(instr.shape)
    params.sort(key=lambda p: p.index)
    return HloSummary(params, instrs, outputs)


def _parse_instr(line: str) -> Instr | None:
    match = _INSTR.match(line)
    if not match:
        return None
    rest = match["rest"]
    shape, rest = _split_shape(rest)
    op = _OPCODE.match(rest)
    if not op:
        return None
    args = _inside_parens(rest[len(op["opcode"]):])
    source = _SOURCE.search(rest)
    op_type = _OP_TYPE.search(rest)
    opcode = op["opcode"]
    return Instr(opcode=opcode, shape=_LAYOUT.sub("", shape),
                 op_type=op_type["op"] if op_type else "",
                 value=args if opcode == "constant" and "[]" in shape else "",
                 where=f"{source['file']}:{source['line']}" if source else "",
                 index=int(args) if opcode == "parameter" and args.isdigit() else -1,
                 bounds=bounds[1] if opcode == "slice" and (bounds := _BOUNDS.search(rest)) else "")


def _split_shape(rest: str) -> tuple[str, str]:
    """`f32[8,4]{1,0} dot(...)` -> ("f32[8,4]{1,0}", "dot(...)"); tuple shapes are parenthesised."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i + 1], rest[i + 2:]
    return rest, ""


def _inside_parens(text: str) -> str:
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[1:i]
    return ""


def explain(old: HloSummary, new: HloSummary, is_internal: Callable[[str], bool]) -> Explanation:
    """What changed from `old` to `new` (two graphs compiled at the same call site)."""
    for check in (_input_shapes, _special_constants, _structure):
        found = check(old, new, is_internal)
        if found:
            return found
    return Explanation(UNKNOWN, "the two graphs' HLO text is the same")


def _user_where(*groups: list[Instr], is_internal: Callable[[str], bool], mine: bool = True) -> str:
    """The first user line among `groups`, in order: the new graph's instructions, then the old's
    (the first library line instead, when not `mine`).

    The checker traces with line information during the warm-up only (it costs tracing time), so
    a later graph may have no lines; its predecessor's matching instructions do.
    """
    for instrs in groups:
        for instr in instrs:
            if instr.where and is_internal(instr.where.rpartition(":")[0]) != mine:
                return instr.where
    return ""


def _explained(cause: str, detail: str, *groups: list[Instr], is_internal: Callable[[str], bool]) -> Explanation:
    """At the first user line among the differing ops; else at the first library line (timm's CutMix
    slicing a batch on the device: the op that differs was traced inside the library)."""
    where = _user_where(*groups, is_internal=is_internal)
    library = "" if where else _user_where(*groups, is_internal=is_internal, mine=False)
    return Explanation(cause, detail, where, library)


def _minus(a: list[Instr], b: list[Instr]) -> list[Instr]:
    """The instructions of `a` that `b` does not have (as multisets, in `a`'s order)."""
    available = Counter(i.key for i in b)
    out = []
    for instr in a:
        if available[instr.key]:
            available[instr.key] -= 1
        else:
            out.append(instr)
    return out


def _input_shapes(old: HloSummary, new: HloSummary, is_internal: Callable[[str], bool]) -> Explanation | None:
    if len(old.params) != len(new.params):
        return None
    changed = [(a, b) for a, b in zip(old.params, new.params, strict=True) if a.shape != b.shape]
    if not changed:
        return None
    detail = ", ".join(f"input {b.index}: {a.shape} -> {b.shape}" for a, b in changed[:3])
    more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
    return _explained(NEW_INPUT_SHAPE, detail + more, [b for _, b in changed], [a for a, _ in changed],
                      is_internal=is_internal)


def _special_constants(old: HloSummary, new: HloSummary, is_internal: Callable[[str], bool]) -> Explanation | None:
    scalars_old = sum(p.shape.endswith("[]") for p in old.params)
    scalars_new = sum(p.shape.endswith("[]") for p in new.params)
    if len(old.params) - len(new.params) != scalars_old - scalars_new or scalars_old == scalars_new:
        return None  # other inputs changed too: not (only) a scalar turning into a constant
    # Only a Python scalar's constant (prim::Constant) comes from a scalar input or becomes one: of the
    # constants with one value, those are the ones left unmatched (timm's mixing factor of exactly 1, not
    # the 1 inside a mean); a graph traced without lines has no op types, and its order is kept.
    added = _minus(_scalars_last(new.special_constants), old.special_constants)
    removed = _minus(_scalars_last(old.special_constants), new.special_constants)
    if scalars_new < scalars_old:
        values = sorted({c.value for c in added}) or ["0/1"]
        detail = (f"{scalars_old - scalars_new} scalar input(s) became the constant "
                  f"{' and '.join(values)} baked into the graph")
    else:
        values = sorted({c.value for c in removed}) or ["0/1"]
        detail = (f"the constant {' and '.join(values)} became {scalars_new - scalars_old} scalar "
                  "input(s): a Python scalar left the special values 0/1")
    return _explained(NEW_CONSTANT, detail, added, removed, is_internal=is_internal)


def _scalars_last(constants: list[Instr]) -> list[Instr]:
    """The constants with a Python scalar's (prim::Constant) after the others, each group in its order."""
    return sorted(constants, key=lambda c: c.op_type == PYTHON_SCALAR)


def _structure(old: HloSummary, new: HloSummary, is_internal: Callable[[str], bool]) -> Explanation | None:
    """The same program traced with other lengths emits the same instructions in the same order:
    the first position that differs is where the programs part."""
    differ = [i for i, (a, b) in enumerate(zip(old.instrs, new.instrs, strict=False)) if a.key != b.key]
    shorter = min(len(old.instrs), len(new.instrs))
    if len(old.instrs) != len(new.instrs):
        differ.append(shorter)
    if not differ:
        return None
    pairs = [(old.instrs[i] if i < len(old.instrs) else None, new.instrs[i] if i < len(new.instrs) else None)
             for i in differ]
    a, b = pairs[0]
    moved = [(x, y) for x, y in pairs if x is not None and y is not None and x.bounds != y.bounds
             and (x.opcode, x.shape, x.value) == (y.opcode, y.shape, y.value)]
    if moved and len(moved) == len(pairs):  # only slice bounds differ: the same slice at another offset
        x, y = moved[0]
        return _explained(SLICE_OFFSET, f"{len(old.instrs)} ops in both; slice {x.shape} of the same tensor at "
                          f"{x.bounds} -> {y.bounds}: its offset is baked into the graph, a new graph per offset",
                          [y for _, y in moved], [x for x, _ in moved], is_internal=is_internal)
    if a is not None and b is not None:
        named = a if a.op_type else b  # the graph traced with metadata names the op
        what = (f"first difference {named.label.replace(named.shape, a.shape)} -> {b.shape}"
                if a.opcode == b.opcode else f"first difference {a.label} -> {b.label}")
    else:
        # the longer graph's op at the first index past the shorter one
        first = next(x for x in (a, b) if x is not None)
        what = f"{len(new.instrs) - len(old.instrs):+d} ops from {first.label}"
    detail = f"{len(old.instrs)} -> {len(new.instrs)} ops; {what}"
    return _explained(GRAPH_STRUCTURE, detail, *([x for x in pair if x is not None] for pair in pairs),
                      is_internal=is_internal)
