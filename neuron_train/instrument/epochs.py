"""The tour to the first epoch's end (precompile -- CMD without --steps): where a script's epochs
end, read from its DataLoaders.

Code that runs once per epoch (evaluation, a checkpoint, mesh_reduce) compiles graphs of its own,
after the epoch's last batch: a tour that stops once the training step is warm never sees them.
So the tour watches DataLoaders and torch_xla's device loaders (MpDeviceLoader, ParallelLoader):
the loader that fed the first step gives the epoch's length; when a loader that ran to its end
(StopIteration) is iterated again, its next epoch begins, and what ran in between is the
once-per-epoch code. Then the tour fast-forwards (Epochs.fast_forward): the remaining epochs are cut
short so the code after the training loop runs too. An epoch longer than MAX_EPOCH_STEPS, or steps no
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
        self.feeder: int | None = None        # id() of that loader
        self.cut: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # fast-forward: the
        # feeder's iterators -> batches left (a device loader's thread iterates it: cut there too)
        self.fast = False                     # fast-forwarding (fast_forward() was called)
        self.started = False                  # ... and the running epoch's iterator was cut
        self.lock = threading.Lock()

    def fast_forward(self) -> str:
        """Once every call site is warm past the first epoch's end: end the remaining epochs early so
        the code after the training loop runs (its graphs are then precompiled too). The feeding
        loader's running epoch ends at its next batch and each later epoch yields one batch (a
        per-epoch average never divides by zero); a transformers Trainer is told to stop training at
        its next callback event (control.should_training_stop). Returns the words."""
        self.fast = True
        trainer = _stop_trainers()
        return ("graph tour complete (every call site warm past the first epoch's end): fast-forwarding to the "
                "script's end, " + ("the Trainer told to stop training and " if trainer else "")
                + "the remaining epochs cut to one batch each, so the code after the training loop runs")

    def take(self, loader: object, it: object) -> bool:
        """Fast-forward: may the feeding loader's iterator `it` yield another batch?"""
        if not self.fast or id(loader) != self.feeder:
            return True
        with self.lock:
            left = self.cut.setdefault(it, 0 if not self.started else 1)  # the running epoch: none left
            self.cut[it], self.started = left - 1, True
        return left > 0

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
        if self.fast:
            return  # the feeder stays the loader of the training steps
        try:
            self.feeding, self.feeder = len(loader), id(loader)
        except TypeError:  # an iterable without __len__
            self.feeding = self.feeder = None

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
            if loader is not None and not epochs.take(loader, self):
                raise StopIteration  # fast-forward: this epoch of the training loader ends here
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
            if not epochs.take(self._loader._cpu_loader, self):
                raise StopIteration  # fast-forward: the batches its threads prefetched are left unread
            try:
                return device_next(self)
            except StopIteration:
                epochs.ended_one(self._loader._cpu_loader)
                raise

        # Monkeypatching torch's and torch_xla's loader classes:
        DataLoader.__iter__, _BaseDataLoaderIter.__next__ = __iter__, __next__  # type: ignore[method-assign]
        pl.ParallelLoader.__init__, pl.PerDeviceLoader.next = parallel_init, next_on_device  # type: ignore[method-assign]


def _stop_trainers() -> bool:
    """Make every transformers Trainer stop training at its next callback event (the Trainer ends its
    epoch loop then, runs its end of training and returns from train()); False without transformers."""
    module = sys.modules.get("transformers.trainer_callback")
    handler = getattr(module, "CallbackHandler", None)
    if handler is None:
        return False
    call_event = handler.call_event

    def stopping(self: Any, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control = call_event(self, event, args, state, control, **kwargs)
        control.should_training_stop = control.should_epoch_stop = True
        return control

    handler.call_event = stopping
    return True


def say(words: str) -> None:
    print(f"neuron-train: {words}", file=sys.stderr, flush=True)
