"""Price-performance: measuring a workload (`measure`, and `script_bench` for any command), the
instance catalog and prices (`catalog`), Neuron's published figures (`references`), the result file's
schema (`schema`), and turning results into tables and charts (`rows`, `render`, `charts`). The
commands are neuron_train/commands/bench.py and report.py.

May import: `neuron_train.common`, `neuron_train.training` to run the loop it measures,
`neuron_train.instrument` to run any command, and the checker's report helpers. Never a command.
"""
