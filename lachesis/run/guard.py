"""``python -m lachesis.run.guard CMD...``: run CMD as a child of a guard that leads
its process group, and kill the whole group if the supervisor dies.

``PR_SET_PDEATHSIG`` only reaches a process's direct children, and vLLM's engine core,
torchrun's workers etc. are grandchildren of the supervisor: when the supervisor is killed
outright, the guard gets SIGHUP from the kernel and SIGKILLs its group, grandchildren
included. SIGTERM and SIGINT are passed on to CMD; the guard exits as CMD did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from lachesis.run.processes import GUARD_PARENT_VARIABLE, prctl_parent_death_signal


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m lachesis.run.guard CMD [ARGS...]", file=sys.stderr)
        return 2
    # The starter's pid as it gave it: if it died before this process got here, getppid()
    # would already name the reaper and the check below would pass.
    parent = int(os.environ.pop(GUARD_PARENT_VARIABLE, os.getppid()))

    def kill_group(signum, frame):
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGHUP, kill_group)
    prctl_parent_death_signal(signal.SIGHUP)
    if os.getppid() != parent:  # the supervisor died before the signal was armed
        kill_group(None, None)
    child = subprocess.Popen(argv)  # same process group: the guard leads it

    def forward(signum, frame):
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    if code < 0:  # die the way the child did, so the supervisor sees the same signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
