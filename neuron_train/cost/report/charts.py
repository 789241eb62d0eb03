"""The report's PNG charts (matplotlib, Agg): one panel per workload, a provenance footer on each.

Charts a person reads without the code: a title saying which way is better, axis labels with units,
the baseline marked, measured / CPU / imported bars told apart, and where the numbers come from.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING

from neuron_train.cost.catalog import money
from neuron_train.cost.report.rows import Group, Row

if TYPE_CHECKING:  # matplotlib itself is imported when a chart is drawn
    import numpy as np
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

COLORS = {"measured": "#2b6cb0", "imported": "#dd8452", "estimated": "#6b46c1"}
CPU_HATCH = "///"
ESTIMATE_HATCH = ".."
_BAR_H = 0.42      # inches per bar, at least
_LINE_H = 0.15     # inches per line of a bar's label
_PANEL_PAD = 1.05  # inches per panel for its title and axis label


def _legend_handles(groups: list[Group]) -> list[Patch]:
    from matplotlib.patches import Patch

    rows = [r for g in groups for r in g.rows]
    handles: list[Patch] = []
    if any(r.origin == "measured" and not r.device.startswith("CPU") for r in rows):
        handles.append(Patch(color=COLORS["measured"], label="measured here"))
    if any(r.origin == "measured" and r.device.startswith("CPU") for r in rows):
        handles.append(Patch(facecolor="white", edgecolor=COLORS["measured"], hatch=CPU_HATCH,
                             label="measured here on the CPU XLA device (not Neuron hardware)"))
    if any(r.origin == "imported" for r in rows):
        handles.append(Patch(color=COLORS["imported"], label="imported (published Neuron SDK table)"))
    if any(r.origin == "estimated" for r in rows):
        handles.append(Patch(facecolor="#e9e3f5", edgecolor=COLORS["estimated"], hatch=ESTIMATE_HATCH,
                             label="ESTIMATE by neuron-train plan (not measured)"))
    return handles


def _bar_style(row: Row) -> dict:
    if row.origin == "measured" and row.device.startswith("CPU"):
        return {"facecolor": "white", "edgecolor": COLORS["measured"], "hatch": CPU_HATCH}
    if row.origin == "estimated":
        return {"facecolor": "#e9e3f5", "edgecolor": COLORS["estimated"], "hatch": ESTIMATE_HATCH}
    return {"color": COLORS.get(row.origin, "#999999")}


def _ylabel(row: Row) -> str:
    return "\n".join([row.instance_type] + textwrap.wrap(row.config_text, 28, break_on_hyphens=False))


def _row_height(group: Group) -> float:
    """Inches per bar: room for the longest label, so labels of neighbouring bars never overlap."""
    lines = max(_ylabel(r).count("\n") + 1 for r in group.rows)
    return max(_BAR_H, _LINE_H * lines + 0.1)


def _panel(ax: Axes, group: Group, value: Callable[[Row], float | None], label: Callable[[Row], str],
           missing: Callable[[Row], str], xlabel: str, baseline_x: float | None = None,
           spread: Callable[[Row], float | None] = lambda r: None) -> None:
    rows = group.rows
    ys = list(range(len(rows)))[::-1]
    ends = [(value(r) or 0) + (spread(r) or 0) for r in rows]
    top = max(ends + [1e-12]) if any(ends) else 1.0
    for y, row, end in zip(ys, rows, ends, strict=True):
        v = value(row)
        if v:
            ax.barh(y, v, height=0.6, **_bar_style(row))
            if spread(row):
                ax.errorbar(v, y, xerr=spread(row), color="#222222", capsize=3, lw=1)
            ax.text(end + top * 0.015, y, label(row), va="center", fontsize=8)
        else:
            ax.text(top * 0.015, y, missing(row), va="center", fontsize=8, color="#777777",
                    style="italic")
    ax.set_yticks(ys, [_ylabel(r) for r in rows], fontsize=8)
    ax.set_xlim(0, top * 1.5)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel(xlabel, fontsize=8.5)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(group.title, fontsize=9.5, loc="left", fontweight="bold")
    if baseline_x is not None and group.baseline is not None:
        ax.axvline(baseline_x, color="#c53030", linestyle="--", linewidth=1.2)
        ax.set_title(f"dashed line = baseline {group.baseline.instance_type} (1.0x)", fontsize=8,
                     loc="right", color="#c53030")


def _figure(groups: list[Group], title: str, footer: str, ncols: int = 1) -> tuple[Figure, np.ndarray]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    heights = [len(g.rows) * _row_height(g) + _PANEL_PAD for g in groups]
    width = 11 if ncols == 1 else 14
    footer_lines = textwrap.wrap(footer, int(width * 16))
    legend = _legend_handles(groups)
    top_in, bottom_in = 0.75 + (0.3 if legend else 0), 0.2 + 0.15 * len(footer_lines)
    total = sum(heights) + top_in + bottom_in
    fig, axes = plt.subplots(len(groups), ncols, figsize=(width, total), layout="constrained",
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    # Constrained layout places the panels inside this rectangle; title, legend and the
    # provenance footer live in the margins around it.
    engine = fig.get_layout_engine()
    assert isinstance(engine, ConstrainedLayoutEngine)  # layout="constrained" above
    engine.set(rect=(0, bottom_in / total, 1, 1 - (top_in + bottom_in) / total),
               h_pad=0.08, hspace=0.05, wspace=0.08)
    fig.text(0.5, 1 - 0.12 / total, title, fontsize=13, fontweight="bold", ha="center", va="top")
    if legend:
        fig.legend(handles=legend, loc="upper center", ncol=len(legend), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, 1 - 0.5 / total))
    fig.text(0.01, 0.1 / total, "\n".join(footer_lines), fontsize=7, color="#555555", va="bottom")
    return fig, axes


def _png(fig: Figure) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _unsupported_or(text: str) -> Callable[[Row], str]:
    def missing(row: Row) -> str:
        if row.origin == "unsupported":
            return "not supported: " + textwrap.shorten(row.note, 70, placeholder="...")
        return text.format(row=row)
    return missing


def _dollar_axis(ax: Axes) -> None:
    """Dollar tick labels in plain decimals (a tiny epoch cost must not turn into '1e-5')."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: "$0" if v == 0 else money(v, 2)))


def throughput_chart(groups: list[Group], footer: str) -> bytes:
    fig, axes = _figure(groups, "Throughput by instance type (higher is better)", footer)
    for ax, g in zip(axes[:, 0], groups, strict=True):
        _panel(ax, g, lambda r: r.samples_per_sec,
               lambda r: f"{r.samples_per_sec:,.1f}" + (f" ± {r.spread:,.1f}" if r.spread else ""),
               _unsupported_or("no measurement"),
               f"{g.unit} per second (measured: median of repeats, error bar = spread, warm-up and "
               "compile excluded; imported: as published)", spread=lambda r: r.spread)
    return _png(fig)


def _relative_label(unit: str) -> Callable[[Row], str]:
    return lambda r: f"{r.relative:.2f}x  ({r.samples_per_dollar:,.0f} {unit} per $)"


def price_performance_chart(groups: list[Group], footer: str) -> bytes:
    fig, axes = _figure(groups, "Price-performance relative to the baseline (higher is better)", footer)
    for ax, g in zip(axes[:, 0], groups, strict=True):
        _panel(ax, g, lambda r: r.relative, _relative_label(g.unit),
               _unsupported_or("no price for {row.instance_type}: add it with --prices FILE"),
               f"{g.unit} per dollar, relative to the baseline (x)",
               baseline_x=1.0 if g.baseline else None)
    return _png(fig)


def cost_chart(groups: list[Group], footer: str) -> bytes:
    fig, axes = _figure(groups, "Cost per million samples and per epoch (lower is better)", footer,
                        ncols=2)
    no_price = _unsupported_or("no price for {row.instance_type}")
    for (ax_m, ax_e), g in zip(axes, groups, strict=True):
        _panel(ax_m, g, lambda r: r.usd_per_million, lambda r: money(r.usd_per_million), no_price,
               f"USD per 1 million {g.unit}")
        _dollar_axis(ax_m)
        if g.epoch_samples:
            _panel(ax_e, g, lambda r: r.usd_per_epoch, lambda r: money(r.usd_per_epoch), no_price,
                   f"USD per epoch of {g.epoch_samples:,} {g.unit}")
            _dollar_axis(ax_e)
        else:
            ax_e.axis("off")
            ax_e.text(0.0, 0.5, "cost per epoch: epoch size unknown\n(pass --epoch-samples N)",
                      fontsize=8.5, color="#777777", style="italic", transform=ax_e.transAxes)
    return _png(fig)


CHARTS = {
    "throughput.png": ("Throughput by instance type", throughput_chart),
    "price_performance.png": ("Price-performance relative to the baseline", price_performance_chart),
    "cost.png": ("Cost per million samples and per epoch", cost_chart),
}


def render_charts(groups: list[Group], footer: str) -> tuple[dict[str, bytes], dict[str, str]]:
    """PNG bytes and a title per chart file name."""
    shown = [g for g in groups if g.rows]
    images = {name: draw(shown, footer) for name, (_, draw) in CHARTS.items()}
    return images, {name: title for name, (title, _) in CHARTS.items()}
