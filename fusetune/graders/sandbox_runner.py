"""The sandbox's inside: run as a script (`python -I sandbox_runner.py`) by fusetune/graders/sandbox.py, with an
empty environment, it shuts itself in and then grades samples one at a time, each in a forked child with its
own limits. Standard library only: nothing of fusetune is readable from in here.

Protocol, one JSON object a line. In: the configuration, then one {"sample", "item"} per sample. Out: one
{"protections": [...]} (or {"unavailable": why}) once shut in, then one {"score"} or {"error", "raised"} per
sample.

Shutting in, in this order (each step is one the kernel either grants or refuses; refused ones are reported):
1. new user, network and mount namespaces: no network interface but a loopback that is down;
2. a tmpfs of `file_bytes` mounted on the scratch directory, so files written there cannot fill the disk;
3. Landlock: read-only access to the Python installation and the system libraries, read-write to the scratch
   directory, nothing else (not /etc, not /proc, not the service's data); no execve anywhere; no TCP bind or
   connect (ABI 4); no signal to a process outside the sandbox and no abstract unix socket (ABI 6).
Each sample's child then sets rlimits (address space, CPU seconds, file size, processes, no core file) and a
seccomp filter (libseccomp, through pyseccomp): no new process (fork, vfork, clone without CLONE_THREAD), no
socket but a unix one, no signal but to itself, no ptrace. The filter is what stops a fork when the service
runs as root: the kernel exempts root from RLIMIT_NPROC, and the user namespace keeps the same root. Then it
runs `grade(sample, item)` with its output sent to /dev/null.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
import traceback

import pyseccomp as seccomp

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
# Landlock's system calls have these numbers on every architecture.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
RESULT_LIMIT_BYTES = 64 * 1024

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _fail(what: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{what}: {os.strerror(errno)}")


def _fs_rights(abi: int) -> int:
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def landlock(read_paths: list[str], write_paths: list[str], file_paths: list[str]) -> list[str]:
    """Restricts this process and its children to the given paths; returns what it restricted."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        raise _fail("Landlock")
    handled_fs = _fs_rights(abi)
    attr = [handled_fs]
    applied = [f"landlock ABI {abi}: files readable only under the Python installation and system libraries"]
    if abi >= 4:
        attr.append(NET_BIND_TCP | NET_CONNECT_TCP)
        applied.append("landlock: no TCP bind or connect")
    if abi >= 6:
        attr.append(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
        applied.append("landlock: no signal or abstract unix socket outside the sandbox")
    packed = struct.pack(f"{len(attr)}Q", *attr)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, packed, len(packed), 0)
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    read = FS_READ_FILE | FS_READ_DIR
    write = handled_fs & ~FS_EXECUTE
    rules = [(path, read) for path in read_paths] + [(path, write) for path in write_paths]
    rules += [(path, (FS_READ_FILE | FS_WRITE_FILE) & handled_fs) for path in file_paths]
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this system does not have
        if not os.path.isdir(path):
            rights &= FS_FILE_RIGHTS
        rule = struct.pack("=Qi", rights, fd)
        if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0) < 0:
            raise _fail(f"landlock_add_rule {path}")
        os.close(fd)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _fail("no_new_privs")
    if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0) < 0:
        raise _fail("landlock_restrict_self")
    os.close(ruleset)
    return applied


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def shut_in(config: dict) -> list[str]:
    """Everything the kernel grants of the module docstring's steps 1-3; raises OSError for a step the sandbox
    cannot do without (the network and the files)."""
    applied = []
    scratch = config["scratch"]
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS) != 0:
        raise _fail("unshare (user and network namespaces)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    applied.append("network namespace: no interface but a loopback that is down")
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0 and libc.mount(
        b"tmpfs", scratch.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
        f"size={max(config['file_bytes'], 4096)},mode=0700".encode(),
    ) == 0:  # fmt: skip
        applied.append(f"scratch directory: a tmpfs of {config['file_bytes']:,} bytes")
    applied += landlock(config["read_paths"], [scratch], ["/dev/null"])
    return applied


CLONE_THREAD = 0x00010000


def seccomp_filter() -> None:
    """This process may start threads but no process, open unix sockets only, and signal only itself."""
    deny = seccomp.ERRNO(1)  # EPERM
    rules = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    for call in (
        "fork",
        "vfork",
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "pidfd_send_signal",
        "tkill",
        "pidfd_open",
        "bpf",
        "perf_event_open",
        "io_uring_setup",
        "setns",
        "unshare",
    ):
        rules.add_rule(deny, call)
    # glibc starts threads with clone3 and falls back to clone on ENOSYS, whose flags a filter can read.
    rules.add_rule(seccomp.ERRNO(38), "clone3")
    rules.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_THREAD, 0))
    rules.add_rule(deny, "socket", seccomp.Arg(0, seccomp.NE, 1))  # AF_UNIX
    rules.add_rule(deny, "socketpair", seccomp.Arg(0, seccomp.NE, 1))
    rules.add_rule(deny, "kill", seccomp.Arg(0, seccomp.NE, os.getpid()))
    rules.add_rule(deny, "tgkill", seccomp.Arg(0, seccomp.NE, os.getpid()))
    rules.load()


def _limit(name: int, value: int) -> None:
    resource.setrlimit(name, (value, value))


def _child(code, config: dict, request: dict, result_fd: int, workdir: str) -> None:
    """The forked child: limits, then the grader. Never returns."""
    status = 1
    try:
        os.chdir(workdir)
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        seconds = max(1, math.ceil(config["timeout_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
        _limit(resource.RLIMIT_AS, config["memory_bytes"])
        _limit(resource.RLIMIT_FSIZE, config["file_bytes"])
        _limit(resource.RLIMIT_NPROC, 0)
        _limit(resource.RLIMIT_CORE, 0)
        seccomp_filter()
        try:
            namespace = {"__name__": "grader", "__builtins__": __builtins__}
            exec(code, namespace)  # noqa: S102 -- the sandbox is this process; see the module docstring
            value = namespace["grade"](request["sample"], request["item"])
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                reply = {"error": f"grade() returned {repr(value)[:80]}, not a finite number", "raised": True}
            else:
                reply = {"score": float(value)}
        except MemoryError:
            reply = {"error": f"ran out of its {config['memory_bytes']:,} bytes of memory", "raised": False}
        except BaseException as exc:  # noqa: BLE001 -- whatever the grader raised is its error
            where = traceback.extract_tb(exc.__traceback__)[-1]
            line = f" (line {where.lineno})" if where.filename == "grader.py" else ""
            reply = {"error": f"{type(exc).__name__}: {str(exc)[:300]}{line}", "raised": True}
        os.write(result_fd, json.dumps(reply).encode()[:RESULT_LIMIT_BYTES])
        status = 0
    finally:
        os._exit(status)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def grade_one(code, config: dict, request: dict, index: int) -> dict:
    workdir = os.path.join(config["scratch"], f"sample-{index}")
    os.mkdir(workdir, 0o700)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(code, config, request, write_end, workdir)
    os.close(write_end)
    deadline = time.monotonic() + config["timeout_s"]
    received = b""
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([read_end], [], [], left)
        if not ready:
            continue
        chunk = os.read(read_end, RESULT_LIMIT_BYTES)
        if not chunk or len(received) >= RESULT_LIMIT_BYTES:
            break
        received += chunk
    os.close(read_end)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(workdir, ignore_errors=True)
    if timed_out:
        return {"error": f"timed out after {config['timeout_s']:g} s", "raised": False}
    try:
        reply = json.loads(received)
        if isinstance(reply, dict) and ("score" in reply or "error" in reply):
            return reply
    except ValueError:
        pass
    if os.WIFSIGNALED(status):
        name = _signal_name(os.WTERMSIG(status))
        cause = " (its CPU-time limit)" if name in ("SIGXCPU", "SIGKILL") else ""
        return {"error": f"was killed by {name}{cause}", "raised": False}
    return {"error": f"exited with status {os.WEXITSTATUS(status)} before returning a score", "raised": False}


def main() -> None:
    config = json.loads(sys.stdin.readline())
    try:
        protections = shut_in(config)
        code = compile(config["source"], "grader.py", "exec")
    except (OSError, SyntaxError, ValueError) as exc:
        print(json.dumps({"unavailable": str(exc)}), flush=True)
        return
    print(json.dumps({"protections": protections}), flush=True)
    if config.get("probe"):
        return
    for index, line in enumerate(sys.stdin):
        print(json.dumps(grade_one(code, config, json.loads(line), index)), flush=True)


if __name__ == "__main__":
    main()
