"""The XLA training loop and what it is made of: typed config (which fields change the graphs is
declared on the fields), device/backend, data, models, optimizer, ZeRO-1, checkpoints, metrics, the
step-phase profiler, tasks (classification, distillation, sifting) and the loop's link to the
compile cache (`cache_hook`). `neuron-train train` is neuron_train/commands/train.py.

May import: `neuron_train.common`; the checker through `neuron_train.graphs` (GraphWatch,
prepare_process); the compile cache library (`neuron_train.precompile`) from `cache_hook` only.
Never a command.
"""
