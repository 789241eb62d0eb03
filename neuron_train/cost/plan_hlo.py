"""FLOPs and bytes of an XLA graph, read from its HLO text (what `neuron-train plan` measures).

Only dot and convolution count (the matrix units' work; element-wise work is left to the
calibrated fraction of peak). dot: 2 x output elements x the contracted size; convolution: 2 x
output elements x the kernel's elements per output feature. Bytes in and out: the entry
computation's parameters and results, i.e. what the graph reads from and writes to device memory.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
_DOT = re.compile(r"=\s*(\w+)\[([0-9,]*)\]\S*\s+dot\((\w+)\[([0-9,]*)\]\S*\s+[^,]+,.*?lhs_contracting_dims=\{([0-9,]*)\}")
_CONV = re.compile(r"=\s*(\w+)\[([0-9,]*)\]\S*\s+convolution\((\w+)\[([0-9,]*)\]\S*\s+[^,]+,\s*(\w+)\[([0-9,]*)\]"
                   r".*?dim_labels=\w+_(\w+)->")
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

    @property
    def precision(self) -> str:
        """The dtype most of the FLOPs run in (f32 when there is none)."""
        if not self.flops_by_dtype:
            return "fp32"
        dtype = max(self.flops_by_dtype, key=lambda k: self.flops_by_dtype[k])
        return {"bf16": "bf16", "f16": "fp16"}.get(dtype, "fp32")


def _shapes_bytes(text: str) -> float:
    return float(sum(DTYPE_BYTES[m.group(1)] * math.prod(_dims(m.group(2))) for m in _SHAPE.finditer(text)))


def hlo_figures(text: str) -> HloFigures:
    """FLOPs of the dots and convolutions of every computation in `text`, and the entry's bytes."""
    out = HloFigures()
    for line in text.splitlines():
        entry = _ENTRY.match(line.strip())
        if entry:
            out.bytes_in, out.bytes_out = _shapes_bytes(entry.group(1)), _shapes_bytes(entry.group(2))
            continue
        dot = _DOT.search(line)
        if dot:
            lhs = _dims(dot.group(4))
            contracted = math.prod(lhs[int(i)] for i in _dims(dot.group(5)))
            _add(out, dot.group(3), 2.0 * math.prod(_dims(dot.group(2))) * contracted)
            out.dots += 1
            continue
        conv = _CONV.search(line)
        if conv:
            rhs, labels = _dims(conv.group(6)), conv.group(7)
            per_output = math.prod(rhs) / rhs[labels.index("o")] if "o" in labels and rhs else 0
            _add(out, conv.group(3), 2.0 * math.prod(_dims(conv.group(2))) * per_output)
            out.convolutions += 1
    return out


def _add(out: HloFigures, dtype: str, flops: float) -> None:
    out.flops += flops
    out.flops_by_dtype[dtype] = out.flops_by_dtype.get(dtype, 0.0) + flops
