"""Price-performance: `bench`, `report` and `plan` (neuron_train/commands/bench.py, report.py and
plan.py parse their options and run these steps in order), three wings over one ground.

- the ground, what two or three wings share: `catalog` (instance types, prices, `money`), `schema`
  (the bench result's versioned schema, the one check bench writes through and report and plan read
  through), `results` (the results a file holds: a bench result or a plan file's estimates),
  `script_figures` (the steady state of a command run under the probe: bench measures it, plan
  counts its step).
- `bench/`, measuring this machine; `report/`, comparing; `plan/`, estimating before renting (each
  wing's `__init__` lists its modules).

A wing imports the ground and never another wing; the ground imports no wing
(tests/test_architecture.py). May import: `neuron_train.common`, `neuron_train.training` to run the
loop it measures, `neuron_train.instrument` to run any command, and the checker's report helpers.
Never a command.
"""
