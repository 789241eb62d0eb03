"""bench, measuring this machine (see neuron_train/cost/__init__.py)."""
