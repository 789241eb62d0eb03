"""Imported by Python at start-up in every process `neuron-train check-graphs` runs.

Arms the graph checker and the probe (neuron_train.instrument.start) when check-graphs, precompile or
bench asked for it, then runs the `sitecustomize` this one shadows, if the environment has one.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _arm() -> None:
    if not os.environ.get("NEURON_TRAIN_GRAPHS_DIR"):
        return
    try:
        from neuron_train.instrument import start
    except ImportError:  # another interpreter than the one neuron_train is installed in
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))))
        from neuron_train.instrument import start
    start.arm()


def _run_shadowed() -> None:
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


try:
    _arm()
except Exception as exc:  # the user's command must still run
    print(f"neuron-train check-graphs: could not instrument {sys.argv[:1]}: {exc!r}", file=sys.stderr)
_run_shadowed()
