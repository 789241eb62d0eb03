"""Shared leaf helpers: error types, file-system edges, Neuron environment facts.

May import: the standard library only (never another neuron_train subpackage). Everything else may
import it.
"""
