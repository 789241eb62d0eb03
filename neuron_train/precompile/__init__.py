"""The compile cache and what it holds: which settings determine a run's graphs and whether a cache
covers them (`coverage`), the cache directory, its locks and manifest (`store`, `manifest`), keeping
it sound (`maintenance`: verify, quarantine, prune), moving it between hosts (`archive`: pack,
unpack), what `cache list` shows (`listing`), what every user of a cache agrees on (`cache_env`: the
compiler flags, how a tour fills the cache and the one printer of a precompile's plan, recording a
graph tour, the one check before anything compiles into it), our loop's precompile tour
(`loop_precompile`), and for any PyTorch/XLA script its precompile tour (`script_precompile`) and the
coverage check of its real run (`script_check`, used by check-graphs --compile-cache).

May import: `neuron_train.common`, the checker's report helpers (`neuron_train.graphs`) and
`neuron_train.instrument` (to run a script). Never `training`, `cost` or a command: the training
loop's cache hook lives in training/cache_hook.py and imports this package, not the other way.
"""
