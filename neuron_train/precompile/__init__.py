"""Precompile and the compile cache: which settings determine a run's graphs (`coverage`), the cache
directory, its locks and manifest (`store`), keeping it sound (`maintenance`: verify, quarantine,
prune), moving it between hosts (`archive`: pack, unpack), what `cache list` shows (`listing`), the
training loop's hook that records or checks graphs (`hook`), and the `neuron-train precompile`
(`command`) / `neuron-train cache` (`cache_command`) commands.

May import: `neuron_train.common`, `neuron_train.training.config` (a run's settings). Never the
training loop, the checker's internals or `cost`.
"""
