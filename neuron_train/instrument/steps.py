"""Step windows of a script's run and the rules read from them (pure): when a call site is warm,
when the graph tour may stop, which intervals are the steady state.

A *step* is a sync that ran a graph; its *window* is what happened since the previous one (timed
when the sync returned, its call site, graphs compiled, the largest host-to-device copy). The probe
(probe.py) folds windows through `Sites` as they come, to stop the process; bench and plan
(cost/script_figures.py) folds the recorded windows the same way, to measure.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepWindow:
    """One sync that ran a graph, and what happened since the previous one."""

    step: int              # syncs that ran a graph so far, this one included
    t: float               # time.perf_counter() when the sync returned
    site: str              # the innermost user line above the sync
    compiled: int          # graphs compiled in this window
    batch: list[int] | None = None   # shape of the largest host-to-device copy in this window
    executed_s: float = 0.0          # torch_xla's ExecuteTime so far (s): the device's share of the time


@dataclass
class SiteState:
    first: int                 # index of its first window
    last: int = 0              # index of its latest window
    visits: int = 0
    quiet_run: int = 0         # windows in a row, up to the last one, that compiled nothing
    steady: list[tuple[int, float]] = field(default_factory=list)  # (closing window, seconds)

    @property
    def warm(self) -> bool:
        return self.quiet_run >= 2


class Sites:
    """Call-site states, updated one step window at a time (the in-process stop and the parent's
    analysis fold the same windows through this one class).

    A steady interval runs from one window of a site to the next, of the same site, both compiling
    nothing: intervals spanning another site's windows (an evaluation) or a compile are left out.
    """

    def __init__(self) -> None:
        self.by_site: dict[str, SiteState] = {}
        self.count = 0
        self.last: StepWindow | None = None
        self.next_epoch: int | None = None   # windows before a DataLoader began its second epoch

    def add(self, w: StepWindow) -> None:
        s = self.by_site.setdefault(w.site, SiteState(first=self.count))
        if self.last is not None and self.last.site == w.site and not w.compiled and s.quiet_run >= 1:
            s.steady.append((self.count, w.t - self.last.t))
        s.visits += 1
        s.last = self.count
        s.quiet_run = s.quiet_run + 1 if not w.compiled else 0
        self.count += 1
        self.last = w

    def main_site(self) -> tuple[str, SiteState] | None:
        """The step's call site: the most steady intervals, then the most windows."""
        if not self.by_site:
            return None
        return max(self.by_site.items(), key=lambda kv: (len(kv[1].steady), kv[1].visits))

    def tour_complete(self, steps: int) -> bool:
        """N steps done and every call site warm (two windows in a row compiled nothing).

        A site seen once (set-up, a once-per-epoch evaluation) holds the tour until as many steps
        have run after it as before it, so a once-per-epoch site is seen a second time (its second
        visit may compile another graph, e.g. an accumulator that starts as a Python number).
        """
        if self.count < max(steps, 1):
            return False
        return all(s.warm or (s.visits == 1 and self.count - 1 - s.first >= s.first)
                   for s in self.by_site.values())

    def epoch_began(self) -> None:
        """A DataLoader the script had run to its end is iterated again: its next epoch begins."""
        if self.next_epoch is None:
            self.next_epoch = self.count

    def past_first_epoch(self, steps: int) -> bool:
        """The tour to the first epoch's end: a loader began its second epoch (so what runs once per
        epoch, after the first one's last batch, has run: evaluation, checkpoint, mesh_reduce), N
        steps done, two steps ran in the new epoch and every call site that ran there is warm. Sites
        seen only at the epoch boundary have run their once-per-epoch work and need not be warm."""
        if self.next_epoch is None or self.count < max(steps, 1) or self.count - self.next_epoch < 2:
            return False
        return all(s.warm for s in self.by_site.values() if s.last >= self.next_epoch)

    def stop_reason(self, mode: str, steps: int, to_epoch_end: bool = False) -> str | None:
        if mode == "tour" and steps > 0 and (self.past_first_epoch(steps) if to_epoch_end
                                             else self.tour_complete(steps)):
            return "tour"
        main = self.main_site()
        if mode == "bench" and steps > 0 and main and len(main[1].steady) >= steps:
            return "bench"
        return None


def fold(windows: list[StepWindow]) -> Sites:
    sites = Sites()
    for w in windows:
        sites.add(w)
    return sites
