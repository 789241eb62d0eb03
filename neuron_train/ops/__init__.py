"""Operating a machine: the facts `neuron-train doctor` gathers (`facts`: devices, Neuron SDK
versions, cache location, limits), the pure checks over them (`checks`, with the pinned versions)
and the report of them (`report`: text and JSON).
The command itself is neuron_train/commands/doctor.py.

May import: `neuron_train.common` only.
"""
