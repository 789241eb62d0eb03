"""Running a user's command with our hooks armed in each of its Python processes.

`runner` runs a command with the start-up hook (`_startup/`) first on its PYTHONPATH and merges its
processes' graph records; `script` runs it for precompile, check-graphs --compile-cache and bench;
`probe` is the part inside its processes (step windows, why it stopped); `steps` the rules on step
windows (pure).
"""
