"""Precompile and the compile cache: which settings determine a run's graphs (`coverage`), the cache
directory, its locks and manifest (`store`), keeping it sound (`maintenance`: verify, quarantine,
prune), moving it between hosts (`archive`: pack, unpack), what `cache list` shows (`listing`), the
training loop's hook that records or checks graphs (`hook`), and the `neuron-train precompile`
(`command`) / `neuron-train cache` (`cache_command`) commands. Any other PyTorch/XLA command:
`script` runs it instrumented, `script_probe` is the part inside its processes (step windows, the
tour's stop, --require-precompiled), `steps` the rules on step windows (pure), `script_precompile`
its tour, `script_check` the coverage options cli.py adds to check-graphs.

May import: `neuron_train.common`, `neuron_train.training.config` and `config_io` (a run's settings, its flags), and the
checker's runner, process set-up, frames and records (to run any command instrumented). Never the
training loop or `cost`.
"""
