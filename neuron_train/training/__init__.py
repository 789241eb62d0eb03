"""The XLA training loop and what it is made of: typed config, device/backend, data, models,
optimizer, ZeRO-1, checkpoints, metrics, the step-phase profiler, and tasks (classification,
distillation, sifting). `command` is `neuron-train train` (and `neuron_train/run.py`).

May import: `neuron_train.common`; from the checker and the cache only their small hook objects
(`neuron_train.graphs.GraphWatch` / `prepare_process`, `neuron_train.precompile.hook`). Never a
command module of another product.
"""
