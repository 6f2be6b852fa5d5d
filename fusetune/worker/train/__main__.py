"""`torchrun --nproc_per_node N -m fusetune.worker.train --config job.json` (or `python -m ...` for one process)."""

from __future__ import annotations

import argparse
import os
import sys

from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.process import die_with_parent, lower_session_priority


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusetune.worker.train", description=__doc__)
    parser.add_argument("--config", required=True, help="path of the job's TrainConfig JSON")
    args = parser.parse_args(argv)
    # Under torchrun each rank is a child of the launcher: if the launcher is killed (a `kill -9` of the
    # worker takes it down), the ranks must go too, or an orphan would keep training beside the retry.
    die_with_parent()
    # torchrun starts each rank in a session of its own: keep the launcher's (inherited) low priority.
    lower_session_priority()
    config = TrainConfig.read(args.config)
    # Models come from local directories or the local cache only: without this, transformers still probes
    # the hub for some files (retrying for half a minute) when a model id is not in the cache. Set before
    # huggingface_hub is first imported, which reads it once.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from fusetune.worker.train.launch import run  # torch and transformers load only once the config is good

    return run(config)


if __name__ == "__main__":
    exit_status = main()
    # Tearing down torch and transformers at interpreter exit takes seconds. Everything the run wrote is closed
    # by now, so leave at once: a stopped job's processes are gone, and its GPU memory free, that much sooner.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_status)
