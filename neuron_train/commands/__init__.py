"""One module per `neuron-train` subcommand (cli.py dispatches to them)."""
