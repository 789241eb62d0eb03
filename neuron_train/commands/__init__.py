"""One module per `neuron-train` command, each with `configure_parser(parser)` and `main(args)`.

cli.py's table points at them. A command may import any library package; no library imports a command.
"""
