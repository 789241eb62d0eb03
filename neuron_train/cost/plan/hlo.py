"""FLOPs and bytes of an XLA graph, read from its HLO text (what `neuron-train plan` measures).

Only dot and convolution count (the matrix units' work; element-wise work is left to the
calibrated fraction of peak). dot: 2 x output elements x the contracted size; convolution: 2 x
output elements x the kernel's elements per output feature (divided by the input dilation of a
transposed convolution, whose inserted zeros are not multiplied). Bytes in and out: the entry
computation's parameters and results, i.e. what the graph reads from and writes to device memory.
Instructions: every instruction of every computation of the unoptimized module, what lazy tracing
builds op by op on the host (the unit of the host term of a lazy step, plan/model.host_rest_s).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([0-9,]*)\]")
_DOT = re.compile(r"=\s*(\w+)\[([0-9,]*)\]\S*\s+dot\((.*?)\),.*?lhs_contracting_dims=\{([0-9,]*)\}")
_CONV = re.compile(r"=\s*(\w+)\[([0-9,]*)\]\S*\s+convolution\((.*?)\),.*?dim_labels=\w+_(\w+)->")
_OPERAND = re.compile(r"^\s*(?:(\w+)\[([0-9,]*)\]\S*\s+)?%?([\w.\-]+)\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\S")
_LHS_DILATE = re.compile(r"lhs_dilate=([0-9x]+)")
_ENTRY = re.compile(r"^ENTRY\s+\S+\s+\((.*)\)\s+->\s+(.*)\{\s*$")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


@dataclass
class HloFigures:
    flops: float = 0.0
    flops_by_dtype: dict[str, float] = field(default_factory=dict)
    bytes_in: float = 0.0
    bytes_out: float = 0.0
    dots: int = 0
    convolutions: int = 0
    instructions: int = 0
    conv_flops: float = 0.0        # the convolutions' share of `flops`

    @property
    def precision(self) -> str:
        """The dtype most of the FLOPs run in (f32 when there is none)."""
        if not self.flops_by_dtype:
            return "fp32"
        dtype = max(self.flops_by_dtype, key=lambda k: self.flops_by_dtype[k])
        return {"bf16": "bf16", "f16": "fp16"}.get(dtype, "fp32")


def _shapes_bytes(text: str) -> float:
    return float(sum(DTYPE_BYTES[m.group(1)] * math.prod(_dims(m.group(2))) for m in _SHAPE.finditer(text)))


def _operands(text: str, shapes: dict[str, tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of each operand: printed inline (`f32[4,8]{1,0} %x`) or defined earlier (`%x`)."""
    out = []
    for part in text.split(", "):
        m = _OPERAND.match(part)
        if m and m.group(1):
            out.append((m.group(1), _dims(m.group(2))))
        elif m and m.group(3) in shapes:
            out.append(shapes[m.group(3)])
        else:
            return []
    return out


def hlo_figures(text: str) -> HloFigures:
    """FLOPs of the dots and convolutions of every computation in `text`, and the entry's bytes.
    Operand shapes are read inline when printed (torch_xla's HLO text) or from their definitions
    (XLA's --xla_dump_to files)."""
    out = HloFigures()
    shapes: dict[str, tuple[str, list[int]]] = {}
    for line in text.splitlines():
        entry = _ENTRY.match(line.strip())
        if entry:
            out.bytes_in, out.bytes_out = _shapes_bytes(entry.group(1)), _shapes_bytes(entry.group(2))
            continue
        if _INSTRUCTION.match(line):
            out.instructions += 1
        d = _DEF.match(line)
        if d:
            shapes[d.group(1)] = (d.group(2), _dims(d.group(3)))
        _count(out, line, shapes)
    return out


def _count(out: HloFigures, line: str, shapes: dict[str, tuple[str, list[int]]]) -> None:
    dot = _DOT.search(line)
    if dot:
        ops = _operands(dot.group(3), shapes)
        if len(ops) == 2:
            contracted = math.prod(ops[0][1][int(i)] for i in _dims(dot.group(4)))
            _add(out, ops[0][0], 2.0 * math.prod(_dims(dot.group(2))) * contracted)
            out.dots += 1
        return
    conv = _CONV.search(line)
    if conv:
        ops, labels = _operands(conv.group(3), shapes), conv.group(4)
        if len(ops) == 2 and "o" in labels and ops[1][1]:
            rhs = ops[1][1]
            flops = 2.0 * math.prod(_dims(conv.group(2))) * math.prod(rhs) / rhs[labels.index("o")]
            dilated = _LHS_DILATE.search(line)
            if dilated:  # a transposed convolution (an input's gradient): the zeros between inputs cost nothing
                flops /= math.prod(int(d) for d in dilated.group(1).split("x"))
            _add(out, ops[0][0], flops)
            out.conv_flops += flops
            out.convolutions += 1


def _add(out: HloFigures, dtype: str, flops: float) -> None:
    out.flops += flops
    out.flops_by_dtype[dtype] = out.flops_by_dtype.get(dtype, 0.0) + flops
