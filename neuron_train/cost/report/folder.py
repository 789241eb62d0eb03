"""The report folder: report.md, report.csv, a self-contained report.html and PNG charts, checked
before any work (it holds nothing but a previous report), every file built in memory, then published
at once (common.fileio.publish_folder), so a failure never leaves a half-written or mixed report.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from neuron_train.common.errors import UsageError
from neuron_train.common.fileio import LISTED, publish_folder, recover_folder, refuse_unusable
from neuron_train.cost.report.render import Context, render_html, render_markdown, report_blocks, write_csv
from neuron_train.cost.report.rows import Group

OUTPUT_FILES = ("report.md", "report.csv", "report.html", "throughput.png", "price_performance.png",
                "cost.png")


def check_out_dir(out: Path, force: bool) -> None:
    """Before any work: the report folder can be created or replaced, and nothing else is in it.

    A report is published whole (built beside the folder, then swapped in), so the folder must hold
    nothing but a previous report, which is replaced only with --force. Leftovers of a killed
    report run are cleaned first and never block a new one.
    """
    refuse_unusable(out, "--out", but=errno.ENOTDIR)  # under a file: said below, naming the file
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise UsageError(f"--out {out} is the current folder or holds it: a report folder is replaced whole; "
                         "give a folder of its own (--out report)")
    recover_folder(out, OUTPUT_FILES)
    if out.is_symlink():
        raise UsageError(f"--out {out} is a symbolic link: give the folder it points to")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    ours = set(OUTPUT_FILES) | {LISTED}
    foreign = [n for n in present if n not in ours or not (out / n).is_file() or (out / n).is_symlink()]
    if foreign:
        raise UsageError(f"--out {out} holds files that are not part of a report ({', '.join(foreign[:3])}): "
                         "a report folder is replaced whole; choose another --out")
    if present and not force:
        raise UsageError(f"{out} already holds a report ({', '.join(present)}): choose another "
                         "--out or pass --force to replace it")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: folder {parent} is not writable: choose another location")


def write_report(out: Path, groups: list[Group], ctx: Context) -> list[str]:
    """Draw the charts, render the tables, then publish the folder whole; returns the charts' names."""
    from neuron_train.cost.report.charts import render_charts

    images, titles = render_charts(groups, ctx.footer())
    blocks = report_blocks(groups, ctx, titles)
    # Every file is complete in memory before the folder is touched; it is then published whole.
    publish_folder(out, {**images, "report.csv": write_csv(groups).encode(),
                         "report.md": render_markdown(blocks).encode(),
                         "report.html": render_html(blocks, images).encode()}, known=OUTPUT_FILES)
    return list(images)
