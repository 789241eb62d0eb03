"""One NeuronCore's share of `bench --mode infer` on trn1/inf2 (Neuron hardware only).

Started by `percore.run_per_core` with NEURON_RT_VISIBLE_CORES set to its core: loads the model that
`torch_neuronx.trace` compiled (saved with torch.jit.save), warms up, says READY, waits for the
parent's line, times its steps and prints one JSON line (the protocol in percore.py).

    python -m neuron_train.cost.core_worker MODEL.pt BATCH IMG_SIZE DTYPE STEPS WARMUP
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:  # pragma: no cover (Neuron hardware only)
    import torch
    import torch_neuronx  # noqa: F401  registers the Neuron ops the saved module calls

    path, dtype = argv[0], argv[3]
    batch, img, steps, warmup = int(argv[1]), int(argv[2]), int(argv[4]), int(argv[5])
    model = torch.jit.load(path)
    x = torch.randn(batch, 3, img, img, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    with torch.no_grad():
        for _ in range(max(warmup, 1)):  # the first call loads the model onto this NeuronCore
            model(x)
        print("READY", flush=True)
        sys.stdin.readline()  # released with the other cores: the timed windows overlap
        times = []
        start = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            model(x)  # host tensor in, host tensor out: what a server does
            times.append(time.perf_counter() - t)
        total = time.perf_counter() - start
    times.sort()
    print(json.dumps({"samples_per_sec": batch * steps / total, "step_time_ms": times[len(times) // 2] * 1e3}),
          flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
