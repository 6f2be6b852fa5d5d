"""The entrypoint of a fusetune job on a Ray cluster: one torchrun per node, on a placement group.

`python -m fusetune.worker.ray_driver --nnodes N --nproc-per-node P --unit GPU|CPU -- <torchrun's arguments>`
is what fusetune/worker/ray_engine.py submits. It reserves a STRICT_SPREAD placement group of N bundles (one per
node, each the P GPUs, or P CPUs on a cluster without GPUs, of that node's ranks), starts one `NodeLauncher`
actor in each bundle, and has each run `torchrun --nnodes N --nproc-per-node P --node-rank i --rdzv-backend
static --rdzv-endpoint <node 0>:<port>` with the trainer's arguments. The static rendezvous keeps node i's ranks
at i*P..i*P+P-1 and global rank 0 on node 0, as the worker expects (rank 0 writes the job's outcome file).

It exits with the first non-zero exit status of a node's torchrun (75 when a node was lost), having stopped the
other nodes' torchruns at once: torchrun tears down its own node's ranks when one of them fails, but the ranks
of another node would wait in a collective until gloo's or NCCL's timeout. On SIGTERM (Ray's `stop_job`, which
the worker calls on cancel, pause and hand-over) it stops every node's torchrun before it exits, so a stopped
Ray job leaves no training process; each torchrun also dies with its actor (Linux's parent-death signal) if the
actor is killed, and the trainer's ranks die with their torchrun as they do on one host.

With `--stage-from-store` (files and checkpoints in the object store, no disk shared with the worker), each
node's launcher first stages the run into the node's own data directory (`run_storage.stage_on_node`, from the
config in the environment), every node at once, and its torchrun reads the config written there; once rank 0's
torchrun has ended, its node publishes the outcome files to the store for the worker. A node that cannot stage
the run (a base model it lacks, a store that fails) fails the job with the reason in its log, before any
torchrun starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fusetune.worker import run_storage
from fusetune.worker.ray_engine import NODE_LOST_EXIT, STAGED_CONFIG_ENV
from fusetune.worker.train.checkpoints.store import TENANT_ENV
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.process import die_with_parent

# Seconds between two looks at a node's torchrun, and how long a stopped torchrun has to end its ranks before
# SIGKILL (the worker passes its terminate_grace_s).
POLL_S = 0.2
DEFAULT_TERMINATE_GRACE_S = 5.0


@ray.remote
class NodeLauncher:
    """Runs one node's torchrun. An async actor: `stop` runs while `run` waits, and every call runs on the
    actor's one event-loop thread, which lives as long as the actor: the parent-death signal that torchrun
    asks for fires when the thread that started it ends."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.stopped = False

    async def rendezvous_endpoint(self) -> str:
        """This node's address and a port free on it, for the static rendezvous's store (node 0's)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    async def stage(self, config_json: str) -> str:
        """Stages the run on this node (in a thread: `stop` stays answerable); the path of its config here."""
        config = TrainConfig.from_json(config_json)
        return str(await asyncio.to_thread(run_storage.stage_on_node, config))

    async def run(
        self, command: list[str], cwd: str, threads_per_rank: int, staged: tuple[str, int, bool] | None = None
    ) -> int:
        """Runs the node's torchrun to its end. `staged`: (job id, attempt, whether this is rank 0's node) of a
        run staged on the node, whose folder `cwd` is then cleared of its scratch, rank 0's node having first
        published the outcome files to the store."""
        if self.stopped:
            return -signal.SIGTERM
        try:
            return await self._run_torchrun(command, cwd, threads_per_rank)
        finally:
            if staged is not None:
                job_id, attempt, publishes_outcome = staged
                await asyncio.to_thread(
                    run_storage.finish_on_node, Path(cwd), os.environ[TENANT_ENV], job_id, attempt,
                    publishes_outcome,
                )  # fmt: skip

    async def _run_torchrun(self, command: list[str], cwd: str, threads_per_rank: int) -> int:
        # Ray sets OMP_NUM_THREADS to the actor's CPUs, all of the node's ranks'; each rank gets its share, as
        # torchrun on one host gives it.
        env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank)}
        # A session of its own, so `stop` signals torchrun and nothing of Ray's; the ranks follow torchrun.
        self.process = subprocess.Popen(
            command,
            cwd=cwd if Path(cwd).is_dir() else None,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        while self.process.poll() is None:
            await asyncio.sleep(POLL_S)
        return self.process.returncode

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to torchrun (which passes it to its ranks and waits for them); after `grace_s`, SIGKILL to
        torchrun and every process under it. Returns once torchrun has ended."""
        self.stopped = True
        process = self.process
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        waited = 0.0
        while process.poll() is None and waited < grace_s:
            await asyncio.sleep(POLL_S)
            waited += POLL_S
        if process.poll() is not None:
            return
        # The ranks run in sessions of their own, out of reach of torchrun's group, and one that had not yet
        # asked to die with torchrun (it does so as it starts) would outlive it: each is killed by its pid,
        # found before torchrun's death hands them to another parent.
        for pid in [*descendants(process.pid), process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while process.poll() is None:
            await asyncio.sleep(POLL_S)


def descendants(pid: int) -> list[int]:
    """The processes under `pid`, children before their own children, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name, in parentheses, may hold spaces: the parent's pid is the second field after it.
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def bundle(unit: str, nproc: int) -> dict[str, float]:
    # A GPU rank also takes a CPU for its host work; a CPU rank is its CPU.
    return {"GPU": nproc, "CPU": nproc} if unit == "GPU" else {"CPU": nproc}


def torchrun_command(
    nnodes: int, nproc: int, node_rank: int, endpoint: str, trainer_args: list[str]
) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        f"--node-rank={node_rank}", "--rdzv-backend=static", f"--rdzv-endpoint={endpoint}", *trainer_args,
    ]  # fmt: skip


def with_config(trainer_args: list[str], config_path: str) -> list[str]:
    """The trainer's arguments with its `--config` replaced by `config_path` (a node's own copy)."""
    index = trainer_args.index("--config")
    return [*trainer_args[: index + 1], config_path, *trainer_args[index + 2 :]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusetune.worker.ray_driver", description=__doc__)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--unit", choices=("GPU", "CPU"), required=True)
    parser.add_argument("--cwd", default=".", help="the ranks' working directory where a node has it")
    parser.add_argument("--terminate-grace-s", type=float, default=DEFAULT_TERMINATE_GRACE_S)
    parser.add_argument("--attempt", type=int, default=1, help="the job's attempt this Ray job runs")
    parser.add_argument(
        "--stage-from-store", action="store_true",
        help=f"each node stages the run from the object store, its config JSON in ${STAGED_CONFIG_ENV}",
    )  # fmt: skip
    parser.add_argument(
        "trainer_args", nargs=argparse.REMAINDER, help="-- then torchrun's script and arguments"
    )
    args = parser.parse_args(argv)
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args

    ray.init()  # the cluster this Ray job runs on
    launchers: list = []

    def stop_all() -> None:
        for stopped in [launcher.stop.remote(args.terminate_grace_s) for launcher in launchers]:
            try:
                ray.get(stopped)
            except ray.exceptions.RayError:
                pass  # a node that is gone has nothing left to stop

    def on_sigterm(signum, frame) -> None:
        stop_all()
        print("fusetune: stopped every node's torchrun", flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    resources = bundle(args.unit, args.nproc_per_node)
    group = placement_group([resources] * args.nnodes, strategy="STRICT_SPREAD")
    print(
        f"fusetune: waiting for {args.nnodes} node(s) with {args.nproc_per_node} free {args.unit}(s) each",
        flush=True,
    )
    ray.get(group.ready())
    launchers += [
        NodeLauncher.options(
            # The actor holds its bundle, so Ray hands it (and torchrun, and the ranks) that node's GPUs in
            # CUDA_VISIBLE_DEVICES, as many as the node's ranks.
            num_cpus=resources["CPU"],
            num_gpus=resources.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote()
        for index in range(args.nnodes)
    ]
    endpoint = ray.get(launchers[0].rendezvous_endpoint.remote())
    print(
        f"fusetune: {args.nnodes} node(s) x {args.nproc_per_node} rank(s), rendezvous at {endpoint}",
        flush=True,
    )
    threads_per_rank = max(1, int(resources["CPU"]) // args.nproc_per_node)
    node_args = [(trainer_args, args.cwd, None)] * args.nnodes
    if args.stage_from_store:
        config_json = os.environ[STAGED_CONFIG_ENV]
        job_id = TrainConfig.from_json(config_json).job_id
        staging = [launcher.stage.remote(config_json) for launcher in launchers]
        node_args = []
        for index, staged in enumerate(staging):
            try:
                config_path = ray.get(staged)
            except ray.exceptions.RayTaskError as exc:
                print(f"fusetune: node {index} could not stage the run: {exc.cause}", flush=True)
                return 1
            except ray.exceptions.RayError as exc:
                print(f"fusetune: node {index} was lost: {type(exc).__name__}: {exc}", flush=True)
                return NODE_LOST_EXIT
            staged_run = (job_id, args.attempt, index == 0)
            node_args.append(
                (with_config(trainer_args, config_path), str(Path(config_path).parent), staged_run)
            )
        print(f"fusetune: {args.nnodes} node(s) staged the run from the store", flush=True)
    pending = {
        launcher.run.remote(
            torchrun_command(args.nnodes, args.nproc_per_node, index, endpoint, node_trainer_args),
            cwd,
            threads_per_rank,
            staged_run,
        ): index
        for index, (launcher, (node_trainer_args, cwd, staged_run)) in enumerate(
            zip(launchers, node_args, strict=True)
        )
    }
    # The first failure is the job's: the nodes stopped after it exit by the signal that stopped them. A lost
    # node is the job's failure whenever it is seen: the ranks of the other nodes fail after it, on a collective
    # whose peer vanished, and may well be seen first.
    first_failure = 0
    lost_nodes: list[int] = []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        node = pending.pop(done[0])
        try:
            code = ray.get(done[0])
        except ray.exceptions.RayTaskError as exc:
            # The actor is there but its call failed (publishing the outcome, say): the job's failure, not a lost
            # node's.
            print(f"fusetune: node {node} failed: {exc.cause}", flush=True)
            code = 1
        except ray.exceptions.RayError as exc:
            # The node (or its actor) is gone: the job fails, and the worker's attempts retry it from its
            # last checkpoint, as they do a torchrun that crashed on one host.
            print(f"fusetune: node {node} was lost: {type(exc).__name__}: {exc}", flush=True)
            lost_nodes.append(node)
            code = NODE_LOST_EXIT
        if code != 0 and first_failure == 0:
            first_failure = code
            if pending:
                print(f"fusetune: node {node} failed ({code}); stopping the others", flush=True)
                stop_all()
    if lost_nodes:
        return NODE_LOST_EXIT
    # A signal's negative status as a shell reports it, so the job's exit code stays in 0..255.
    return first_failure if first_failure >= 0 else 128 - first_failure


if __name__ == "__main__":
    sys.exit(main())
