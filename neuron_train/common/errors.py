"""The two ways a command ends early on purpose: bad input (exit 2) and a refused run (exit 1)."""


class UsageError(ValueError):
    """Bad input from the user: printed as one line, exit code 2."""


class RunError(RuntimeError):
    """The run cannot go on safely (e.g. a world-size mismatch): one line, exit code 1."""
