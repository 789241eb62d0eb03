"""plan, estimating before renting (see neuron_train/cost/__init__.py)."""
