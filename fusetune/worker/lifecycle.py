"""A worker's life beside the process that started it: the worker `fusetune serve` runs stops when `serve` does,
however `serve` ended (a SIGKILL leaves it no chance to stop the worker itself)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from pathlib import Path

_PR_SET_PDEATHSIG = 1
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
# How often the watchdog of platforms without a parent-death signal looks for its parent.
WATCHDOG_INTERVAL_S = 1.0


def detect_gpus() -> int:
    """The training processes this host runs at once: its NVIDIA GPUs (those CUDA_VISIBLE_DEVICES leaves, else
    those the driver lists), or on a host without one its CPU cores (a CPU job's n_gpus are gloo processes).
    Read without importing torch, which the worker itself never needs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = len([device for device in visible.split(",") if device.strip()])
    else:
        gpus = len(list(NVIDIA_GPUS.iterdir())) if NVIDIA_GPUS.is_dir() else 0
    if gpus:
        return gpus
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stop_with_parent(parent_pid: int) -> None:
    """Send this process SIGTERM, the graceful stop that hands a job in training back to the queue, when the
    process `parent_pid` exits: Linux's parent-death signal, elsewhere a thread that watches the parent."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        # A parent that died before the call above sends nothing: look once, now that it is set.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(WATCHDOG_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fusetune-parent-watchdog", daemon=True).start()
