"""Training processes run at low priority also where Linux schedules each session as a group (autogroups)."""

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fusetune.worker.train.process import prepare_training_process

AUTOGROUP = Path("/proc/self/autogroup")
READ_OWN_AUTOGROUP = "print(open('/proc/self/autogroup').read().split()[-1])"


def _autogroups_settable() -> bool:
    """Whether this kernel has autogroups and lets this process set its group's nice value (some containers
    do not, and some sandboxes show the file empty); the code under test then does nothing, by design."""
    try:
        shown = re.fullmatch(r"/autogroup-\d+ nice (-?\d+)", AUTOGROUP.read_text().strip())
        if shown is None:
            return False
        AUTOGROUP.write_text(shown.group(1))
    except OSError:
        return False
    return True


needs_autogroups = pytest.mark.skipif(not _autogroups_settable(), reason="no settable autogroups here")


@needs_autogroups
def test_a_training_session_gets_the_training_niceness_as_a_group():
    # As the worker starts torchrun: a session of its own, prepared in the child before exec.
    started = subprocess.run(
        [sys.executable, "-c", READ_OWN_AUTOGROUP],
        start_new_session=True,
        preexec_fn=functools.partial(prepare_training_process, 10),
        capture_output=True,
        text=True,
        check=True,
    )
    assert started.stdout.strip() == "10"
    # Without it a new session's group competes at nice 0, whatever the process's own nice value.
    plain = subprocess.run(
        [sys.executable, "-c", READ_OWN_AUTOGROUP], start_new_session=True, capture_output=True, text=True
    )
    assert plain.stdout.strip() == "0"


@needs_autogroups
def test_a_rank_in_its_own_session_keeps_the_launchers_niceness(tmp_path):
    # torchrun starts every rank in a new session; the rank's entry point re-applies the inherited nice value.
    code = (
        "import os; os.setsid(); from fusetune.worker.train.process import lower_session_priority; "
        "lower_session_priority(); " + READ_OWN_AUTOGROUP
    )
    rank = subprocess.run(
        ["nice", "-n", "7", sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert rank.stdout.strip() == "7"
