"""The processes of `bench --mode infer` on trn1/inf2 (Neuron hardware; stand-ins in the tests).

`trace`: compiles the model with `torch_neuronx.trace`, saves it with torch.jit.save and exits. It
runs in a process of its own because the Neuron runtime "initializes all the cores present in the
system and reserves them for the current process", and a reserved NeuronCore "cannot be used by
another process at all, until the process reserving that NeuronCore is terminated" (Neuron Runtime
configuration guide): a bench process that traced would keep every core from the per-core workers.

`run`: one NeuronCore's share, started by `percore.run_per_core` with NEURON_RT_VISIBLE_CORES set to
its core: loads the saved model, warms up, says READY, waits for the parent's line, then THREADS
threads call the model for STEPS steps each (NeuronPerf's max-throughput setting is two worker
threads per model per core) and it prints one JSON line (the protocol in percore.py).

    python -m neuron_train.cost.bench.core_worker trace EAGER.pt OUT.pt BATCH IMG_SIZE DTYPE [COMPILER_ARG...]
    python -m neuron_train.cost.bench.core_worker run MODEL.pt BATCH IMG_SIZE DTYPE STEPS WARMUP THREADS
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch itself is imported by each role
    from torch import Tensor


def _input(torch: ModuleType, batch: int, img: int, dtype: str) -> Tensor:
    # Random images, as in the reference study: the data pipeline is not what is measured.
    return torch.randn(batch, 3, img, img, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))


def trace(argv: list[str]) -> int:
    import torch
    import torch_neuronx

    eager, out, batch, img, dtype, compiler_args = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5:]
    model = torch.load(eager, weights_only=False)  # the bench process's own model object, pickled
    traced = torch_neuronx.trace(model, _input(torch, batch, img, dtype), compiler_args=compiler_args)
    torch.jit.save(traced, out)
    return 0  # exiting releases every NeuronCore the runtime reserved while tracing


def _timed(model: Callable[[Tensor], object], x: Tensor, steps: int, threads: int) -> tuple[float, float]:
    """(samples/s, median call ms) of `threads` threads calling the model `steps` times each."""
    times: list[list[float]] = [[] for _ in range(threads)]

    def loop(i: int) -> None:
        for _ in range(steps):
            t = time.perf_counter()
            model(x)  # host tensor in, host tensor out: what a server does
            times[i].append(time.perf_counter() - t)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    total = time.perf_counter() - start
    calls = sorted(t for per_thread in times for t in per_thread)
    return x.shape[0] * steps * threads / total, calls[len(calls) // 2] * 1e3


def run(argv: list[str]) -> int:
    import torch
    import torch_neuronx  # noqa: F401  registers the Neuron ops the saved module calls

    path, dtype = argv[0], argv[3]
    batch, img, steps, warmup, threads = int(argv[1]), int(argv[2]), int(argv[4]), int(argv[5]), int(argv[6])
    model = torch.jit.load(path)
    x = _input(torch, batch, img, dtype)
    with torch.no_grad():
        for _ in range(max(warmup, 1)):  # the first call loads the model onto this NeuronCore
            model(x)
        print("READY", flush=True)
        sys.stdin.readline()  # released with the other cores: the timed windows overlap
        sps, step_ms = _timed(model, x, steps, threads)
    print(json.dumps({"samples_per_sec": sps, "step_time_ms": step_ms}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    roles = {"trace": (trace, 5), "run": (run, 7)}
    if not argv or argv[0] not in roles or len(argv) - 1 < roles[argv[0]][1]:
        print(__doc__.rsplit("\n\n", 1)[-1], file=sys.stderr)
        return 2
    role, _ = roles[argv[0]]
    return role(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
