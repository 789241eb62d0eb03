"""report, comparing (see neuron_train/cost/__init__.py)."""
