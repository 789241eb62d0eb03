"""Operating a machine: `neuron-train doctor` (devices, Neuron SDK versions, cache, limits).

May import: `neuron_train.common` only.
"""
