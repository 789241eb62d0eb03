"""Graph-stability recording (minimal counter-based version; the checker extends it)."""

from __future__ import annotations

from neuron_train.errors import RunError


class GraphWatch:
    def __init__(self, warmup_steps: int, fail_on_recompile: bool = False):
        import torch_xla.debug.metrics as met

        self._met = met
        self.warmup_steps, self.fail = warmup_steps, fail_on_recompile
        self._phase, self._seen = "train", self._count()
        self.graphs: list[dict] = []

    def _count(self) -> int:
        return self._met.counter_value("UncachedCompile") or 0

    def phase(self, name: str) -> None:
        self._phase = name

    def step_end(self, step: int) -> None:
        now = self._count()
        for _ in range(now - self._seen):
            self.graphs.append({"hash": "", "phase": self._phase, "step": step, "compile_time_s": 0.0,
                                "cause": "", "where": ""})
            if self.fail and step >= self.warmup_steps and self._phase == "train":
                raise RunError(f"recompilation at step {step} after warm-up")
        self._seen = now

    def summary(self) -> dict:
        data = self._met.metric_data("CompileTime")
        return {"compile_count": len(self.graphs),
                "compile_time_s": (data[1] / 1e9) if data else 0.0,
                "graphs": self.graphs, "late_graphs": [], "recompiles": [], "host_syncs": [],
                "fallback_ops": {}, "stable": True}
