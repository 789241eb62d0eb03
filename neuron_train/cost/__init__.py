"""Price-performance: what `bench`, `report` and `plan` do (neuron_train/commands/bench.py, report.py
and plan.py parse their options and run these steps in order).

- bench, measuring this machine: `instance` (the EC2 instance type: metadata service, flag or
  'local'; the host's facts), `sweep` (batch sizes x processes once, then repeats of the fastest),
  `measure` (one measurement: our loop's training run or a timed compiled forward pass; on Neuron
  every NeuronCore through `percore` and its `core_worker`; failures classified by `failures`),
  `script_bench` (any training command, measured by the probe), `bench_result` (the result file),
  `schema` (the result file's versioned schema, the one check `report` and `bench` share).
- report, comparing: `rows` (one typed row per measured, estimated, imported or unsupported
  figure), `compare` (the rows read, priced, grouped by workload, compared with a baseline),
  `catalog` (instance types and prices), `references` (Neuron's published tables), `render` (tables,
  CSV, Markdown, HTML), `charts` (PNG), `report_folder` (the folder, checked first, published whole).
- plan, estimating before renting: `plan_measure` (one step traced on the CPU XLA device, or counted
  from shapes), `plan_hlo` (FLOPs and bytes of an HLO graph), `plan_model` (the estimate per instance
  type), `plan_data` (the chips and the published rows of neuron_train/data/plan_published.yaml),
  `plan_calibrate` (the fraction of peak fitted on them, or on one bench), `plan_result` (the printed
  estimates and plan.json).

May import: `neuron_train.common`, `neuron_train.training` to run the loop it measures,
`neuron_train.instrument` to run any command, and the checker's report helpers. Never a command.
"""
