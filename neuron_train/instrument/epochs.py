"""The tour to the first epoch's end (precompile -- CMD without --steps): where a script's epochs
end, read from its DataLoaders.

Code that runs once per epoch (evaluation, a checkpoint, mesh_reduce) compiles graphs of its own,
after the epoch's last batch: a tour that stops once the training step is warm never sees them.
So the tour watches DataLoaders and torch_xla's device loaders (MpDeviceLoader, ParallelLoader):
the loader that fed the first step gives the epoch's length; when a loader that ran to its end
(StopIteration) is iterated again, its next epoch begins, and what ran in between is the
once-per-epoch code. An epoch longer than MAX_EPOCH_STEPS, or steps no
DataLoader of known length feeds, fall back to the warm-sites rule; the process says so at the
first step a loader fed (set-up syncs may come before it), with the --steps that would reach the
epoch's end, or when the warm-sites rule stops a tour no loader fed.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

EPOCH_ENV = "NEURON_TRAIN_PROBE_TO_EPOCH_END"   # "1": tour to the first epoch's end
MAX_EPOCH_STEPS = 1000   # longer epochs are not toured whole by default (a choice: a few minutes of tour)


class Epochs:
    def __init__(self, began: Callable[[], None]) -> None:
        self.began = began                    # called when a loader starts its second epoch
        self.ended: set[int] = set()          # ids of loaders iterated to their end
        self.feeding: int | None = None       # len() of the loader that yielded the latest batch
        self.lock = threading.Lock()

    def plan(self, steps: int) -> tuple[bool, str]:
        """At the first step a loader fed: whether the tour runs to the epoch's end, and the words."""
        length = self.feeding
        if length is None:
            return False, (f"no DataLoader of known length feeds the steps: the tour stops once every call "
                           f"site is warm (at least {steps} steps); code that runs once per epoch is precompiled "
                           f"only if --steps N reaches past it (--steps 0 runs the command whole)")
        if length > MAX_EPOCH_STEPS:
            return False, (f"an epoch is {length} steps, more than the {MAX_EPOCH_STEPS} the tour runs by default: "
                           f"it stops once every call site is warm (at least {steps} steps), before the epoch's "
                           f"end; --steps {length + steps} or more reaches its evaluation or checkpoint "
                           "(--steps 0 runs the command whole)")
        return True, (f"the tour runs to the end of the first epoch ({length} steps) and through what runs "
                      "then (evaluation, checkpoint), until the next epoch's steps are warm")

    def ended_one(self, loader: object) -> None:
        with self.lock:
            self.ended.add(id(loader))

    def starting(self, loader: object) -> None:
        """`loader` is iterated: if it ran to its end before, its next epoch begins."""
        if id(loader) in self.ended:
            self.began()

    def fed(self, loader: Any) -> None:
        """`loader` yielded the latest batch: its length is the epoch's."""
        try:
            self.feeding = len(loader)
        except TypeError:  # an iterable without __len__
            self.feeding = None

    def install(self) -> None:
        """Hooks on torch's DataLoader and on torch_xla's device loaders (MpDeviceLoader and
        ParallelLoader wrap any loader with a length, e.g. xu.SampleGenerator for fake data)."""
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _BaseDataLoaderIter
        from torch_xla.distributed import parallel_loader as pl

        iterate, fetch = DataLoader.__iter__, _BaseDataLoaderIter.__next__
        parallel, device_next = pl.ParallelLoader.__init__, pl.PerDeviceLoader.next
        loaders: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # DataLoader iterator -> loader
        epochs = self

        def __iter__(self: Any) -> Any:
            epochs.starting(self)
            it = iterate(self)
            loaders[it] = self
            return it

        def __next__(self: Any) -> Any:
            loader = loaders.get(self)
            try:
                batch = fetch(self)
            except StopIteration:
                if loader is not None:
                    epochs.ended_one(loader)
                raise
            if loader is not None:
                epochs.fed(loader)
            return batch

        def parallel_init(self: Any, cpu_loader: Any, *args: Any, **kwargs: Any) -> None:
            epochs.starting(cpu_loader)
            parallel(self, cpu_loader, *args, **kwargs)

        def next_on_device(self: Any) -> Any:
            # Noted before the call: PerDeviceLoader.next() syncs before it takes the batch, and that
            # sync closes a step the loader feeds (in the training thread: the loader of its steps).
            epochs.fed(self._loader._cpu_loader)
            try:
                return device_next(self)
            except StopIteration:
                epochs.ended_one(self._loader._cpu_loader)
                raise

        # Monkeypatching torch's and torch_xla's loader classes:
        DataLoader.__iter__, _BaseDataLoaderIter.__next__ = __iter__, __next__  # type: ignore[method-assign]
        pl.ParallelLoader.__init__, pl.PerDeviceLoader.next = parallel_init, next_on_device  # type: ignore[method-assign]


def say(words: str) -> None:
    print(f"neuron-train: {words}", file=sys.stderr, flush=True)
