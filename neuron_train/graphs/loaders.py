"""Hooks on torch DataLoaders: where each loader was made and the shapes of the batches it yields.

When a graph's input changes shape, the line to fix is rarely the compiled step: it is the loader
(a ragged last batch: `drop_last=True`) or its `collate_fn` (padding to each batch's longest). With
MpDeviceLoader the batch reaches the device in a loader thread, so no user line moves it there;
matching the new input shape with the batches each loader yielded names the loader.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Any

from neuron_train.graphs.frames import caller_line, code_line, library_line
from neuron_train.graphs.records import Batch, LoaderOrigin
from neuron_train.graphs.sink import HookSink

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

MAX_TENSORS = 8  # tensors of one batch whose shapes are noted


def install(recorder: HookSink) -> list[Callable[[], None]]:
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    made: weakref.WeakKeyDictionary[DataLoader[Any], str] = weakref.WeakKeyDictionary()  # loader -> LoaderOrigin.key
    by_user: dict[int, LoaderOrigin] = {}  # id(dataset) -> the first loader made over it
    running: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # its iterators -> the same key
    init, iterate, fetch = DataLoader.__init__, DataLoader.__iter__, _BaseDataLoaderIter.__next__

    def __init__(self: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        analyzer = recorder.analyzer
        where = caller_line(analyzer.is_internal, sys._getframe(1)) or ""
        made_here = origin(self, where, library_line(analyzer.is_internal, analyzer.library_of, sys._getframe(1)))
        made_here.accumulation, made_here.logging_steps = _trainer_steps(sys._getframe(1))
        first = by_user.setdefault(id(self.dataset), made_here)
        if first is not made_here and made_here.library:
            # A library re-made an earlier loader over the same data (accelerator.prepare): that one is
            # where its batch size and drop_last are set.
            made_here = replace(made_here, where=first.where, library=first.library or made_here.library,
                                batch_size=first.batch_size, drop_last=first.drop_last or made_here.drop_last,
                                accumulation=first.accumulation or made_here.accumulation,
                                logging_steps=first.logging_steps or made_here.logging_steps)
        made[self] = made_here.key
        recorder.note(made_here)

    def __iter__(self: DataLoader[Any]) -> Any:
        it = iterate(self)
        if self in made:
            running[it] = made[self]
        return it

    def __next__(self: Any) -> Any:
        batch = fetch(self)
        key = running.get(self)
        if key is not None:
            recorder.note(Batch(key, shapes(batch)))
        return batch

    _patch(__init__, __iter__, __next__)

    def restore() -> None:
        _patch(init, iterate, fetch)

    return [restore]


def origin(loader: DataLoader[Any], where: str, library: str = "") -> LoaderOrigin:
    from torch.utils.data._utils.collate import default_collate, default_convert

    try:
        samples = len(loader.dataset)  # type: ignore[arg-type]  # a Dataset may have a length: asked here
    except TypeError:  # an iterable dataset
        samples = None
    collate = loader.collate_fn
    # transformers' Trainer wraps the user's collator (RemoveColumnsCollator): the wrapped one pads
    collate = getattr(collate, "data_collator", collate) if type(collate).__name__ == "RemoveColumnsCollator" \
        else collate
    custom = collate not in (default_collate, default_convert)
    name = getattr(getattr(collate, "func", collate), "__qualname__", type(collate).__name__)
    sampler = loader.batch_sampler  # a loader made with batch_sampler=... has batch_size None
    return LoaderOrigin(key=f"loader-{id(loader)}", where=where,
                        batch_size=loader.batch_size or getattr(sampler, "batch_size", None),
                        drop_last=bool(loader.drop_last or getattr(sampler, "drop_last", False)), samples=samples,
                        collate=name if custom else "", collate_where=code_line(collate) if custom else "",
                        library=library, grouped=_grouped(loader))


def _trainer_steps(frame: FrameType | None, depth: int = 4) -> tuple[int, int]:
    """(gradient_accumulation_steps when > 1, logging_steps when an int) of the transformers Trainer whose
    method made a loader (its `self.args`), looked for in the few frames above DataLoader(...); zeros when
    no Trainer made it. Once per loader."""
    while frame is not None and depth > 0:
        args = getattr(frame.f_locals.get("self"), "args", None)
        steps = getattr(args, "gradient_accumulation_steps", None)
        if type(steps) is int and "transformers" in frame.f_code.co_filename:
            logging = getattr(args, "logging_steps", 0)
            return (steps if steps > 1 else 0), (logging if type(logging) is int else 0)
        frame, depth = frame.f_back, depth - 1
    return 0, 0


def _grouped(loader: DataLoader[Any]) -> bool:
    """Does its sampler group samples by length (transformers' LengthGroupedSampler)? Accelerate re-makes
    the Trainer's loader with the sampler inside its batch_sampler."""
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    return any(type(s).__name__ == "LengthGroupedSampler" for s in samplers)


def shapes(batch: object, limit: int = MAX_TENSORS) -> list[str]:
    """The tensors of a batch (nested tuples, lists, mappings), named as XLA's HLO names them."""
    from collections.abc import Mapping

    import torch

    out: list[str] = []
    todo = [batch]
    while todo and len(out) < limit:
        item = todo.pop(0)
        if isinstance(item, torch.Tensor):
            out.append(hlo_shape(item.dtype, tuple(item.shape)))
        elif isinstance(item, (tuple, list)):
            todo.extend(item)
        elif isinstance(item, Mapping):  # a dict, or transformers' BatchEncoding (a UserDict) from a collator
            todo.extend(item.values())
    return out


def hlo_shape(dtype: object, dims: tuple[int, ...]) -> str:
    name = str(dtype).removeprefix("torch.")
    kind = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "s64",
            "int32": "s32", "int16": "s16", "int8": "s8", "uint8": "u8", "bool": "pred"}.get(name, name)
    return f"{kind}[{','.join(map(str, dims))}]"


def _patch(init: Callable[..., Any], iterate: Callable[..., Any], fetch: Callable[..., Any]) -> None:
    """DataLoader's methods replaced (and put back) through setattr: a deliberate patch of a class's
    methods, which mypy refuses as an assignment (method-assign)."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    setattr(DataLoader, "__init__", init)  # noqa: B010
    setattr(DataLoader, "__iter__", iterate)  # noqa: B010
    setattr(_BaseDataLoaderIter, "__next__", fetch)  # noqa: B010
