"""Start-up hook for `neuron-train check-graphs`: this folder goes first on the command's PYTHONPATH.

Python imports `sitecustomize` from it in every process the command starts (torchrun workers
included). The folder holds nothing else, so it shadows no other module.
"""
