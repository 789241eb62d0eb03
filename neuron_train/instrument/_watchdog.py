"""`python _watchdog.py PGID GRACE_S`: started by proc.py next to each command it runs, in a session
of its own. Reads its stdin, a pipe from the neuron-train process that runs the command, until it
closes: when that process ends, however it ends (kill -9 included), the command's process group
is ended too (SIGTERM, then SIGKILL after GRACE_S). Imports nothing of neuron_train: it must start
fast and work whatever happens to the parent.
"""

import os
import signal
import sys
import time


def main() -> None:
    pgid, grace = int(sys.argv[1]), float(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the parent, which passes it on
    sys.stdin.buffer.read()  # returns when the parent closes the pipe or dies
    sig = signal.SIGTERM
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return  # the group is gone
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        time.sleep(0.1)


if __name__ == "__main__":
    main()
