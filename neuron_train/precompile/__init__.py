"""Precompile and the compile cache: which settings determine a run's graphs (`coverage`), the cache
directory and its manifest (`cache`), the training loop's hook that records or checks graphs
(`hook`), and the `neuron-train precompile` / `neuron-train cache` commands.

May import: `neuron_train.common`, `neuron_train.training.config` (a run's settings). Never the
training loop, the checker's internals or `cost`.
"""
