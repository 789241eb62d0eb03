"""Running a user's command with our hooks armed in each of its Python processes.

`proc` runs a command (or our run.py) as a child that never outlives us (its own process group, a
watchdog, signals passed on); `runner` runs it with the start-up hook (`_startup/` -> `start`)
first on its PYTHONPATH and merges its processes' graph records; `script` runs it for precompile,
check-graphs --compile-cache and bench; `probe` is the part inside its processes (step windows,
why it stopped), `marker` the note each process leaves when it imports torch_xla, `epochs` where
the script's epochs end (the default precompile tour); `steps` the rules on step windows (pure).
"""
