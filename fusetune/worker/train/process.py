"""Process hygiene for training: no training process may outlive the worker that started it.

Both sides call it: the worker in the child it forks for torchrun (`prepare_training_process`), and each rank as
it starts (`__main__.py`), so it lives here, below the worker, and imports nothing of fusetune.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a `kill -9` of the worker or of torchrun).

    Without this, ranks orphaned by a killed worker would keep training while another worker restarts the
    job: two copies of one job. Other platforms have no such call; there the worker's cleanup is all there is.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def prepare_training_process(niceness: int) -> None:
    """Runs in the forked child before torchrun starts: dies with the worker, and yields the CPU to the API
    and the worker's own bookkeeping when cores are scarce (training is throughput work, the API is not)."""
    die_with_parent()
    if niceness:
        os.nice(niceness)
    lower_session_priority()


def lower_session_priority() -> None:
    """Give this process's scheduling autogroup the process's own nice value.

    With Linux's autogroup scheduling (on by default on desktops and many servers), every session is a group
    that competes with other groups at the group's nice value, 0 unless set, whatever its processes' own nice
    values. The training launcher and each rank start sessions of their own, so without this the nice value
    above ranks them only against each other, and a training job takes an equal share of the CPU from the API
    (seen on 2 cores: the job used a whole core while 50 clients polled). A no-op where autogroups are off or
    absent.
    """
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(os.nice(0)))
    except OSError:
        pass
