"""Jobs on a Ray cluster (FUSETUNE_RAY_ADDRESS): a real two-node cluster on localhost (`ray.cluster_utils`,
two CPUs a node, so a 4-rank job is 2 nodes x 2 gloo ranks), the job created through the API and run by the
worker's JobRunner, which submits it through Ray's Job Submission API.

- The job trains, and its per-step loss, gradient norm and learning rate equal those of a single-host
  `torchrun --standalone --nproc_per_node 4` run of the same config bit for bit: the arithmetic is the same.
  The static rendezvous gives node i's ranks the global ranks 2i, 2i+1, so each rank reads the same examples;
  each rank runs with one thread (OMP_NUM_THREADS=1 in both), so its matmuls sum in the same order; gloo's
  all-reduce depends on the world size and the tensor, not on which host a rank sits on (all on loopback here).
- Cancel stops the Ray job, and no process of the job (either node's torchrun, any rank) is left.
- A job asking for more than the cluster has is refused at creation, naming what the cluster has.
- A node killed mid-run (all its Ray processes) fails the job over through its attempts: once a node takes
  its place, the retry resumes from the job's last checkpoint and ends the run.
- With the files and checkpoints in an S3 store (moto's server), each node stages the run into a data
  directory of its own, none of it read from the worker's: the worker's copies of the inputs and of the base
  model are moved away once it has written the config, and the job still succeeds, its checkpoint in the store.
- A stopping worker's hand-over reaches such a run (through the job's row): the trainer saves a checkpoint to
  the store and exits, and the job goes back to the queue with it.

The layout rule (`plan_nodes`) is checked without a cluster.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from fusetune import ray_cluster
from fusetune.api.app import create_app
from fusetune.config import Settings
from fusetune.db.migrate import upgrade
from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
from fusetune.worker import run_storage
from fusetune.worker.tasks import CONFIG_FILE, JobRunner
from fusetune.worker.train.config import TrainConfig
from fusetune.worker.train.reporter import parse_console_records
from tests.services import moto_s3_server

MODEL = "tiny-llama"
NODE_CPUS = 2
BATCH_SIZE = 16
# 2 steps of 16 sequences: the fewest where a step's numbers depend on an earlier step's all-reduced gradients
# and optimizer update; every rank's start costs tens of seconds on the 2-core CI machine.
TRAIN_LINES = 32
TIMEOUT_S = 300
NODE = {"num_cpus": NODE_CPUS, "object_store_memory": 80 * 1024 * 1024}
HANDED_OVER = re.compile(r"Worker \S+ is stopping: training handed over with the checkpoint of step (\d+)")


def test_plan_nodes_puts_a_job_on_the_fewest_nodes_with_as_many_ranks_on_each():
    shape = ray_cluster.ClusterShape("GPU", (8, 8, 0))
    assert ray_cluster.plan_nodes(8, shape) == ray_cluster.NodePlan(1, 8, "GPU")
    assert ray_cluster.plan_nodes(12, shape) == ray_cluster.NodePlan(2, 6, "GPU")
    assert ray_cluster.plan_nodes(16, shape) == ray_cluster.NodePlan(2, 8, "GPU")
    with pytest.raises(
        ray_cluster.ClusterTooSmall, match=r"n_gpus 24 exceeds the cluster's 16 GPUs on 2 nodes"
    ):
        ray_cluster.plan_nodes(24, shape)
    with pytest.raises(ray_cluster.ClusterTooSmall, match="cannot be split evenly"):
        ray_cluster.plan_nodes(9, shape)
    # A cluster without GPUs: a rank is a CPU.
    cpus = ray_cluster.shape_from_resources([{"CPU": 2.0, "memory": 1e9}, {"CPU": 2.0}])
    assert cpus == ray_cluster.ClusterShape("CPU", (2, 2))
    assert ray_cluster.plan_nodes(4, cpus) == ray_cluster.NodePlan(2, 2, "CPU")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until(predicate, what: str, timeout_s: float = TIMEOUT_S, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval_s)
    raise TimeoutError(what)


def _job_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every training process whose command line names `marker`: each node's torchrun
    and its ranks (the driver, whose command line names it too, is not one)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in command and "fusetune.worker.ray_driver" not in command:
                found[int(entry.name)] = command
    return found


def _node(nodes_root: Path, name: str) -> dict:
    """A node's arguments: its data directory of its own, holding its own copy of the base model, as a worker
    host has (a run staged from the store reads only that; a run on local storage reads the worker's paths)."""
    data_dir = nodes_root / name
    build_tiny_model(data_dir / "models" / MODEL)
    return {**NODE, "env_vars": {"FUSETUNE_DATA_DIR": str(data_dir)}}


@pytest.fixture(scope="module")
def ray_test_cluster(tmp_path_factory):
    """A head node and a second node, two CPUs each; shut down (its own processes, by pid) even on failure.
    Yields the cluster, its address and the folder of the nodes' data directories."""
    from ray.cluster_utils import Cluster

    nodes_root = tmp_path_factory.mktemp("ray-nodes")
    cluster = Cluster(
        initialize_head=True,
        # Ray starts its workers (here the actors, so torchrun and the ranks) at nice 15 so that its own daemons
        # stay responsive; on a machine that the rest of the suite shares at nice 0, the ranks would then wait
        # behind every other test. At 0 they share the cores as a local torchrun does.
        head_node_args={**_node(nodes_root, "head"), "include_dashboard": True, "dashboard_host": "127.0.0.1",
                        "dashboard_port": _free_port(), "_system_config": {"worker_niceness": 0}},
    )  # fmt: skip
    try:
        cluster.add_node(**_node(nodes_root, "second"))
        cluster.wait_for_nodes()
        address = f"http://{cluster.head_node.address_info['webui_url']}"

        def both_nodes_seen():
            try:
                return len(ray_cluster.read_cluster(address).slots_per_node) == 2
            except Exception:  # the dashboard is still starting
                return False

        _wait_until(both_nodes_seen, "the dashboard never listed both nodes", interval_s=1)
        yield cluster, address, nodes_root
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def service(ray_test_cluster, tmp_path_factory):
    _, cluster_address, _ = ray_test_cluster
    root = tmp_path_factory.mktemp("ray-service")
    settings = Settings(
        data_dir=root / "data", ray_address=cluster_address, ray_python=sys.executable,
        embedded_worker=False, checkpoint_every_epoch=False,
    )  # fmt: skip
    settings.ensure_dirs()
    upgrade(settings.database_url)
    build_tiny_model(settings.models_dir / MODEL)
    train = root / "train.jsonl"
    train.write_text("".join(TRAIN_FILE.read_text().splitlines(keepends=True)[:TRAIN_LINES]))
    with TestClient(
        create_app(settings), headers={"Authorization": f"Bearer {settings.dev_api_key}"}
    ) as client:
        file_id = client.post(
            "/v1/files", files={"file": ("train.jsonl", train.read_bytes())}, data={"purpose": "fine-tune"}
        ).json()["id"]
        yield settings, client, file_id


def _freeze_ranks(processes: dict[int, str]) -> None:
    """SIGSTOP every rank (not the torchruns): frozen where they stand, the ranks cannot end the run first,
    however fast the machine; torchrun's SIGTERM waits in a stopped rank, and SIGKILL still ends it."""
    for pid, command in processes.items():
        if "torch.distributed.run" not in command:
            os.kill(pid, signal.SIGSTOP)


@contextlib.contextmanager
def _running(runner: JobRunner, client, job_id: str) -> Iterator[tuple[threading.Thread, list[str]]]:
    """The job run by `runner` in a thread (its outcome appended to the list); a test that fails with the job
    still running cancels it and waits, so that no training outlives the test."""
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(runner.run(job_id)))
    worker.start()
    try:
        yield worker, outcome
    finally:
        if worker.is_alive():
            client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
            worker.join(TIMEOUT_S)


def _create_job(client, file_id: str, n_gpus: int, n_epochs: int = 1, batch_size: int = BATCH_SIZE):
    return client.post("/v1/fine_tuning/jobs", json={
        "model": MODEL, "training_file": file_id, "seed": 0,
        "hyperparameters": {"n_epochs": n_epochs, "batch_size": batch_size, "learning_rate": 3e-3, "n_gpus": n_gpus},
    })  # fmt: skip


def _messages(client, job_id: str) -> list[str]:
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    return [event["message"] for event in reversed(events)]


def _ray_job_status(address: str, job_id: str, attempt: int = 1) -> str:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address).get_job_status(f"fusetune-{job_id}-{attempt}").value


@pytest.mark.slow
@pytest.mark.ray
def test_two_nodes_train_on_the_single_host_curve(service, tmp_path):
    settings, client, file_id = service
    response = _create_job(client, file_id, n_gpus=4)
    assert response.status_code == 200, response.text
    job_id = response.json()["id"]
    runner = JobRunner(settings, requeue=lambda job_id: None)
    assert runner.gpus == 2 * NODE_CPUS  # the worker advertises the cluster's capacity
    status = runner.run(job_id)
    log_text = (settings.runs_dir / job_id / "train.log").read_text(errors="replace")
    assert status == "succeeded", "\n".join(_messages(client, job_id)) + "\n" + log_text[-4000:]
    assert _ray_job_status(settings.ray_address, job_id) == "SUCCEEDED"
    assert any("2 node(s) x 2 rank(s) (CPU)" in message for message in _messages(client, job_id))
    resolved = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["resolved"]
    assert (resolved["world_size"], resolved["nodes"], resolved["processes_per_node"]) == (4, 2, 2)
    # The Ray job's log reached the run's train.log: both nodes' torchrun, and the driver.
    assert "--node-rank=0" in log_text or "rendezvous at" in log_text
    metrics = client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()["data"]
    assert [point["step"] for point in metrics] == list(range(1, TRAIN_LINES // BATCH_SIZE + 1))
    # Every rank's memory peaks, with its node: node i holds ranks 2i and 2i + 1.
    for point in metrics:
        ranks = point["rank_memory"]
        assert [(r["rank"], r["node"]) for r in ranks] == [(0, 0), (1, 0), (2, 1), (3, 1)]
        assert (
            max(r["peak_memory_allocated_bytes"] for r in ranks)
            == point["values"]["peak_memory_allocated_bytes"]
        )

    # The same config on one host, four processes, reporting to the console.
    config = TrainConfig.read(settings.runs_dir / job_id / CONFIG_FILE)
    reference = config.model_copy(
        update={"database_url": None, "job_id": None, "output_dir": str(tmp_path / "ref")}
    )
    reference_path = reference.write(tmp_path / "ref.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
         "-m", "fusetune.worker.train", "--config", str(reference_path)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    records = parse_console_records(completed.stdout)
    started = next(r for r in records if r["data"].get("event") == "started")
    assert (started["data"]["world_size"], started["data"]["nodes"]) == (4, 1)
    expected = [r for r in records if r["kind"] == "metric"]
    assert [r["step"] for r in expected] == [point["step"] for point in metrics]
    for key in ("train_loss", "grad_norm", "learning_rate"):
        assert [point["values"][key] for point in metrics] == [r["values"][key] for r in expected], key


@pytest.mark.slow
@pytest.mark.ray
def test_cancel_stops_the_ray_job_and_leaves_no_process_on_either_node(service):
    settings, client, file_id = service
    response = _create_job(client, file_id, n_gpus=4)
    assert response.status_code == 200, response.text
    job_id = response.json()["id"]
    runner = JobRunner(settings, requeue=lambda job_id: None)
    with _running(runner, client, job_id) as (worker, outcome):
        # Cancelled once both nodes' torchruns have started their ranks, the ranks frozen so that the job cannot
        # end by itself first.
        marker = str(settings.runs_dir / job_id / CONFIG_FILE)
        processes = _wait_until(
            lambda: found if len(found := _job_processes(marker)) == 2 + 4 else None,
            "the nodes never started their torchrun and ranks",
        )
        torchruns = [command for command in processes.values() if "torch.distributed.run" in command]
        assert sorted("--node-rank=0" in command for command in torchruns) == [False, True], processes
        _freeze_ranks(processes)
        assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
        worker.join(TIMEOUT_S)
        assert not worker.is_alive()
    assert outcome == ["cancelled"]
    assert _ray_job_status(settings.ray_address, job_id) == "STOPPED"
    # The Ray job is STOPPED only once its driver has exited, and the driver exits only once every node's
    # torchrun has ended its ranks and itself.
    left = {pid: command for pid, command in _job_processes(marker).items() if pid in processes}
    assert left == {}


@pytest.mark.slow
@pytest.mark.ray
def test_a_job_larger_than_the_cluster_is_refused_naming_what_it_has(service):
    _, client, file_id = service
    response = _create_job(client, file_id, n_gpus=8)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "hyperparameters.n_gpus"
    assert error["message"] == "n_gpus 8 exceeds the cluster's 4 CPUs on 2 nodes (2, 2 per node)."
    # Three ranks fit in the cluster's four CPUs, but not with the same number on each node.
    response = _create_job(client, file_id, n_gpus=3, batch_size=12)
    assert response.status_code == 400 and "cannot be split evenly" in response.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.ray
def test_a_lost_node_fails_the_job_over_and_the_retry_resumes_from_its_last_checkpoint(
    ray_test_cluster, service
):
    cluster, _, nodes_root = ray_test_cluster
    settings, client, file_id = service
    response = _create_job(client, file_id, n_gpus=4, n_epochs=3)  # 6 steps
    assert response.status_code == 200, response.text
    job_id = response.json()["id"]
    requeued: list[str] = []
    # A checkpoint at every step: the node is killed once the first is recorded.
    runner = JobRunner(settings.model_copy(update={"checkpoint_every_steps": 1}), requeue=requeued.append)
    run_dir = settings.runs_dir / job_id
    with _running(runner, client, job_id) as (worker, outcome):
        # Recorded in SQL, not only on disk: an attempt's unrecorded checkpoints are removed when it ends.
        _wait_until(
            lambda: client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"],
            "no checkpoint was recorded",
            interval_s=0.05,
        )
        _freeze_ranks(_job_processes(str(run_dir / CONFIG_FILE)))
        (lost,) = cluster.worker_nodes  # the node that is not the head, where the driver runs
        cluster.remove_node(lost, allow_graceful=False)
        worker.join(TIMEOUT_S)
        assert not worker.is_alive()
    assert outcome == ["queued"] and requeued == [job_id], "\n".join(_messages(client, job_id))
    assert not _job_processes(str(run_dir / CONFIG_FILE))
    saved = max(
        c["step_number"] for c in client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    )

    cluster.add_node(**_node(nodes_root, "replacement"))  # a node takes the lost one's place
    cluster.wait_for_nodes()
    assert runner.run(job_id) == "succeeded", "\n".join(_messages(client, job_id))
    messages = _messages(client, job_id)
    assert [m for m in messages if m.startswith("Resumed from the checkpoint")] == [
        f"Resumed from the checkpoint of step {saved}"
    ]
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert [(a["cause"], a["fault"]) for a in job["attempts"]] == [("crashed", True), ("succeeded", False)]
    assert job["error"] is None
    metrics = client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()["data"]
    assert [point["step"] for point in metrics] == list(range(1, 3 * TRAIN_LINES // BATCH_SIZE + 1))


@contextlib.contextmanager
def _service_on_a_store(cluster_address: str, tmp_path: Path, **settings_fields):
    """The service with its files and checkpoints in an S3 store (moto's server) and its database apart from
    the worker's data directory (the nodes reach it, as they must): (settings, client, file id, store)."""
    with moto_s3_server(tmp_path) as s3:
        env = s3.storage_env()
        settings = Settings(
            data_dir=tmp_path / "worker", database_url=f"sqlite:///{tmp_path / 'jobs.db'}",
            ray_address=cluster_address, ray_python=sys.executable,
            embedded_worker=False, checkpoint_every_epoch=False, storage_url=env["FUSETUNE_STORAGE_URL"],
            storage_endpoint=s3.endpoint, storage_access_key_id=env["FUSETUNE_STORAGE_ACCESS_KEY_ID"],
            storage_secret_access_key=env["FUSETUNE_STORAGE_SECRET_ACCESS_KEY"], **settings_fields,
        )  # fmt: skip
        settings.ensure_dirs()
        upgrade(settings.database_url)
        build_tiny_model(settings.models_dir / MODEL)
        lines = TRAIN_FILE.read_text().splitlines(keepends=True)[:TRAIN_LINES]
        with TestClient(
            create_app(settings), headers={"Authorization": f"Bearer {settings.dev_api_key}"}
        ) as client:
            file_id = client.post(
                "/v1/files",
                files={"file": ("train.jsonl", "".join(lines).encode())},
                data={"purpose": "fine-tune"},
            ).json()["id"]
            yield settings, client, file_id, s3


@pytest.mark.slow
@pytest.mark.ray
def test_nodes_without_the_workers_disk_stage_the_run_from_the_store(ray_test_cluster, tmp_path):
    _, cluster_address, nodes_root = ray_test_cluster
    with _service_on_a_store(cluster_address, tmp_path) as (settings, client, file_id, s3):
        job_id = _create_job(client, file_id, n_gpus=4).json()["id"]
        runner = JobRunner(settings, requeue=lambda job_id: None)
        write_config = runner._write_config

        def write_config_then_hide_the_workers_copies(job, run_dir, model_location):
            # Once the config is written the worker needs neither: a node that read the worker's paths
            # would find nothing there.
            path = write_config(job, run_dir, model_location)
            shutil.rmtree(run_dir / run_storage.INPUTS_DIRNAME)
            settings.models_dir.rename(tmp_path / "hidden-models")
            return path

        runner._write_config = write_config_then_hide_the_workers_copies
        status = runner.run(job_id)
        log_text = (settings.runs_dir / job_id / "train.log").read_text(errors="replace")
        assert status == "succeeded", "\n".join(_messages(client, job_id)) + "\n" + log_text[-4000:]
        assert "2 node(s) staged the run from the store" in log_text
        checkpoints = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
        assert [c["step_number"] for c in checkpoints] == [TRAIN_LINES // BATCH_SIZE]
        # Each node trained from its own data directory: the config its ranks read names only paths there.
        staged = sorted(nodes_root.resolve().glob(f"*/runs/{job_id}/{CONFIG_FILE}"))
        assert len(staged) == 2, staged
        for config_path in staged:
            node_dir, config = config_path.parents[2], TrainConfig.read(config_path)
            assert config.model_path == str(node_dir / "models" / MODEL)
            assert (
                Path(config.training_file).parent == node_dir / "runs" / job_id / run_storage.INPUTS_DIRNAME
            )
            assert config.output_dir == str(node_dir / "runs" / job_id)
        # The checkpoint is whole in the store; the outcome the worker fetched is gone from it.
        stored = s3.keys()
        run_prefix = f"fusetune/tenants/default/runs/{job_id}/"
        assert f"{run_prefix}checkpoints/step-2/fusetune-manifest.json" in stored
        assert not [key for key in stored if key.startswith(f"{run_prefix}outcomes/")]


@pytest.mark.slow
@pytest.mark.ray
def test_a_stopping_worker_hands_a_staged_run_over_with_a_checkpoint_in_the_store(ray_test_cluster, tmp_path):
    """The hand-over request reaches rank 0 on a node that does not see the worker's disk (it is in the job's
    row): the trainer saves a checkpoint to the store and exits, and the job goes back to the queue with it."""
    _, cluster_address, nodes_root = ray_test_cluster
    # A grace long enough that only the trainer's own exit, never the worker's deadline, ends the attempt.
    with _service_on_a_store(cluster_address, tmp_path, handover_grace_s=TIMEOUT_S) as (
        settings, client, file_id, s3,
    ):  # fmt: skip
        job_id = _create_job(client, file_id, n_gpus=4, n_epochs=100).json()["id"]  # 200 steps: mid-run below
        runner = JobRunner(settings, requeue=lambda job_id: None)
        with _running(runner, client, job_id) as (worker, outcome):
            _wait_until(
                lambda: client.get(f"/v1/fine_tuning/jobs/{job_id}/metrics").json()["data"],
                "no step was recorded",
                interval_s=0.05,
            )
            runner.stopping.set()  # what the worker's SIGTERM does
            worker.join(TIMEOUT_S)
            assert not worker.is_alive()
        messages = _messages(client, job_id)
        assert outcome == ["queued"], "\n".join(messages)
        handed = [int(match.group(1)) for m in messages if (match := HANDED_OVER.match(m))]
        assert len(handed) == 1, "\n".join(messages)
        step = handed[0]
        checkpoints = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
        assert [c["step_number"] for c in checkpoints] == [step]
        run_prefix = f"fusetune/tenants/default/runs/{job_id}/"
        assert f"{run_prefix}checkpoints/step-{step}/fusetune-manifest.json" in s3.keys()
        job = client.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        assert job["status"] == "queued" and [a["cause"] for a in job["attempts"]] == ["handed_over"]
        assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
