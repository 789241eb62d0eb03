"""plan, estimating before renting: `measure` (one step traced on the CPU XLA device, or counted from
shapes), `hlo` (FLOPs and bytes of an HLO graph), `model` (the estimate per instance type), `data`
(the chips and the published rows of neuron_train/data/plan_published.yaml), `calibrate` (the fraction
of peak fitted on them, or on one bench), `result` (the printed estimates and plan.json).
"""
