"""bench, measuring this machine: `instance` (the EC2 instance type: metadata service, flag or
'local'; the host's facts), `sweep` (batch sizes x processes once, then repeats of the fastest),
`measure` (one measurement: our loop's training run or a timed compiled forward pass; on Neuron every
NeuronCore through `percore` and its `core_worker`; failures classified by `failures`),
`script_bench` (any training command, measured by the probe), `result` (the result file).
"""
