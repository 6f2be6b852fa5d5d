"""Service settings, read from the environment (prefix ``FUSETUNE_``) once and passed down.

Nothing reads settings at import time: the app factory, the worker and the CLI each build one ``Settings``
and hand it to what they create, so tests can point a whole stack at a temporary directory.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fusetune.spec.hyperparameters import DEFAULT_BASE_LEARNING_RATE


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FUSETUNE_", extra="ignore")

    data_dir: Path = Field(
        default=Path(".fusetune"), description="Uploaded files, runs and the embedded database"
    )
    database_url: str = Field(default="", description="SQLAlchemy URL; default: SQLite in data_dir")
    broker_url: str = Field(
        default="", description="Celery broker; default: kombu's SQLAlchemy transport in data_dir"
    )
    models_dir: Path | None = Field(
        default=None, description="Directory of base models; default: data_dir/models"
    )
    # Hugging Face ids, already in the local cache, that jobs may fine-tune besides the models_dir entries.
    hub_models: list[str] = Field(default_factory=list)
    # `serve` builds the bundled tiny model (fusetune.demo.task, about a second) into models_dir at its start when
    # the server offers no base model, so that a fresh install has one to fine-tune; false: never.
    bundled_model: bool = True
    # A key that needs no database row and belongs to the default tenant, so the embedded service works out of
    # the box; set FUSETUNE_DEV_API_KEY="" in production and create real keys with `fusetune keys create`.
    dev_api_key: str = "sk-fusetune-dev"
    # A key for Prometheus alone, apart from tenants' keys. Set: /metrics asks for `Authorization: Bearer <key>`
    # and adds the series that name tenants' jobs; empty: /metrics is open and shows only totals.
    metrics_key: str = Field(default="", repr=False)
    host: str = "127.0.0.1"
    port: int = 8000
    # Embedded mode starts a worker process next to the API so that `fusetune serve` alone is a full service.
    embedded_worker: bool = True
    # HTTP API processes (uvicorn workers). One process answers requests on one core; more spread polling load
    # over the cores (Prometheus then sums request metrics across them through files in data_dir).
    api_processes: int = Field(default=1, ge=1)
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    # One example (a line of a training file). The longest sequence a job may train, 131072 tokens, is about
    # 0.5 MB of English at four characters a token; 4 MiB leaves room for scripts of more bytes a token and for
    # tool schemas, and keeps the data check of one line within seconds.
    max_example_bytes: int = Field(default=4 * 1024 * 1024, ge=1)
    # A request body that sends no bytes for this long is answered 408 and its connection closed.
    body_read_timeout_s: float = Field(default=60.0, gt=0)
    # OpenAI's convention: the job asks for a multiplier of a base learning rate the server chooses.
    # Memory of one worker GPU; when set, jobs whose estimate exceeds it are refused up front, and each training
    # process is capped at it and plans for it (on a card with more, the plan the dry run showed).
    gpu_memory_bytes: int | None = Field(default=None, ge=1)
    base_learning_rate: float = Field(default=DEFAULT_BASE_LEARNING_RATE, gt=0)
    # Resumable checkpoints while a job trains, so that a crash (a killed worker, a lost node) costs the steps since
    # the last one, not the run; the last `keep_last_checkpoints` of a job are kept.
    checkpoint_every_steps: int = Field(default=0, ge=0, description="0: no step-count checkpoints")
    checkpoint_every_epoch: bool = True
    checkpoint_every_minutes: float = Field(default=30.0, ge=0, description="0: no time-based checkpoints")
    keep_last_checkpoints: int = Field(default=2, ge=1)
    # How long the worker waits for a training process to exit after SIGTERM before SIGKILL.
    terminate_grace_s: float = 5.0
    # How long a paused job's trainer may take to save its checkpoint and exit before it is stopped.
    pause_grace_s: float = 300.0
    # How long a worker that is being stopped (SIGTERM, SIGINT, its `serve` gone) waits for its trainer to save a
    # checkpoint and exit; past it the trainer is stopped and the job resumes from its previous checkpoint. Either
    # way the job goes back to the queue at once. `serve` waits this plus terminate_grace_s and 15 s for its
    # worker; a supervisor's stop timeout (systemd's TimeoutStopSec, Kubernetes' terminationGracePeriodSeconds)
    # should be as long.
    handover_grace_s: float = Field(default=60.0, ge=0)
    # Capacity and quotas (fusetune/capacity.py). A worker advertises worker_gpus (None: its CUDA GPUs, or its CPU
    # cores on a host without one) and takes jobs up to that size. A tenant may have at most
    # tenant_max_running_jobs jobs and tenant_max_gpus GPUs training at once (None: no limit); `fusetune tenants
    # limit` sets either for one tenant. A job over a limit waits in the queue with the reason as status_details.
    worker_gpus: int | None = Field(default=None, ge=1)
    tenant_max_running_jobs: int | None = Field(default=None, ge=1)
    tenant_max_gpus: int | None = Field(default=None, ge=1)
    # Crash recovery: a worker renews its job's lease every lease_s / 3; a job whose lease lapsed is requeued
    # (by any worker's reaper, every reaper_interval_s) until it has had max_attempts faults: a lost worker or a
    # crashed trainer each count one; a pause or a stopping worker's hand-over counts none.
    # CPU priority of training processes relative to the API and worker (0 = same).
    training_niceness: int = Field(default=10, ge=0, le=19)
    lease_s: int = Field(default=60, ge=3)
    reaper_interval_s: float = Field(default=10.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)

    # Object storage (fusetune/storage.py). Empty: files and checkpoints stay under data_dir (one host).
    # s3://bucket/prefix: any S3-compatible store, shared by the API and workers on any number of hosts.
    storage_url: str = ""
    storage_endpoint: str = Field(default="", description="e.g. http://minio:9000; empty: AWS S3")
    storage_region: str = "us-east-1"
    # Empty: the client's usual sources (AWS_* variables, a web identity token, instance metadata).
    storage_access_key_id: str = ""
    storage_secret_access_key: str = Field(default="", repr=False)
    storage_part_bytes: int = Field(
        default=16 * 1024 * 1024, ge=5 * 1024 * 1024, description="multipart part"
    )
    storage_max_retries: int = Field(default=5, ge=0)
    storage_retry_timeout_s: float = Field(default=120.0, gt=0)
    storage_connect_timeout_s: float = Field(default=10.0, gt=0)
    # Downloads answered with a 307 to a presigned URL of the store, so their bytes bypass the API (the local
    # store ignores this). The URL names storage_public_endpoint (empty: storage_endpoint): clients must reach it.
    storage_presigned_downloads: bool = False
    storage_presigned_expiry_s: int = Field(default=3600, ge=1, le=7 * 24 * 3600)  # SigV4's longest: 7 days
    storage_public_endpoint: str = ""

    # A Ray cluster's Job Submission address (its dashboard, e.g. http://head:8265). Set: every job trains there,
    # one torchrun per node of a placement group (fusetune/worker/ray_engine.py); empty: on the worker's host.
    # ray_python is the interpreter on the cluster's nodes that has fusetune and `ray[default]` installed.
    ray_address: str = ""
    ray_python: str = "python"

    # Chat completions (fusetune/serving): each worker runs a server of its own for them, which the API finds
    # through the worker's row and calls with a token it writes there. It listens on serving_host:serving_port (0:
    # a free port) and is reached at serving_public_host (empty: serving_host), which must be reachable from the
    # API's hosts only. A model it loaded is unloaded after serving_idle_s without a request, and at once when a
    # training job starts on the worker.
    serving: bool = True
    serving_host: str = "127.0.0.1"
    serving_port: int = Field(default=0, ge=0, le=65535)
    serving_public_host: str = ""
    serving_idle_s: float = Field(default=600.0, gt=0)
    # Sequences decoded together in one step (a request's `n` completions count one each); more wait their turn.
    # Each loaded model keeps a KV cache of serving_max_batch slots of serving_max_len tokens (at most the model's
    # context): a prompt and its completion together fit one slot. Llama-3.2-1B in bf16 takes 32 KiB a token, so
    # 32 x 4096 is 4 GiB.
    serving_max_batch: int = Field(default=32, ge=1)
    serving_max_len: int = Field(default=4096, ge=2)

    # An MLflow tracking server every job reports to (besides a job's own `integrations`); empty: none.
    mlflow_tracking_uri: str = ""

    # Python graders (fusetune/graders/sandbox.py): user code, so off unless the operator turns them on. Each
    # sample is graded in its own sandboxed process with these limits; one over its time or memory scores 0.
    python_graders: bool = False
    python_grader_timeout_s: float = Field(default=10.0, gt=0, le=600)
    python_grader_memory_bytes: int = Field(default=1024 * 1024 * 1024, ge=64 * 1024 * 1024)
    python_grader_file_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    python_grader_processes: int | None = Field(default=None, ge=1, description="None: the CPU cores")

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'fusetune.db'}"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{self.data_dir / 'broker.db'}"
        if self.models_dir is None:
            self.models_dir = self.data_dir / "models"
        self.models_dir = self.models_dir.expanduser().resolve()
        return self

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def runs_dir(self) -> Path:
        return self.data_dir / "runs"

    def ensure_dirs(self) -> None:
        for path in (self.data_dir, self.files_dir, self.runs_dir, self.models_dir):
            path.mkdir(parents=True, exist_ok=True)

    def subprocess_env(self) -> dict[str, str]:
        """The variables a child process (worker, trainer) needs to build the same Settings."""
        return {
            "FUSETUNE_DATA_DIR": str(self.data_dir),
            "FUSETUNE_DATABASE_URL": self.database_url,
            "FUSETUNE_BROKER_URL": self.broker_url,
            "FUSETUNE_MODELS_DIR": str(self.models_dir),
            "FUSETUNE_BASE_LEARNING_RATE": str(self.base_learning_rate),
            "FUSETUNE_CHECKPOINT_EVERY_STEPS": str(self.checkpoint_every_steps),
            "FUSETUNE_CHECKPOINT_EVERY_EPOCH": str(self.checkpoint_every_epoch).lower(),
            "FUSETUNE_CHECKPOINT_EVERY_MINUTES": str(self.checkpoint_every_minutes),
            "FUSETUNE_KEEP_LAST_CHECKPOINTS": str(self.keep_last_checkpoints),
            "FUSETUNE_DEV_API_KEY": self.dev_api_key,
            "FUSETUNE_LEASE_S": str(self.lease_s),
            "FUSETUNE_REAPER_INTERVAL_S": str(self.reaper_interval_s),
            "FUSETUNE_MAX_ATTEMPTS": str(self.max_attempts),
            "FUSETUNE_HANDOVER_GRACE_S": str(self.handover_grace_s),
            "FUSETUNE_TERMINATE_GRACE_S": str(self.terminate_grace_s),
            **{
                f"FUSETUNE_{name.upper()}": str(value)
                for name in ("worker_gpus", "tenant_max_running_jobs", "tenant_max_gpus")
                if (value := getattr(self, name)) is not None
            },
            "FUSETUNE_STORAGE_URL": self.storage_url,
            "FUSETUNE_STORAGE_ENDPOINT": self.storage_endpoint,
            "FUSETUNE_STORAGE_REGION": self.storage_region,
            "FUSETUNE_STORAGE_ACCESS_KEY_ID": self.storage_access_key_id,
            "FUSETUNE_STORAGE_SECRET_ACCESS_KEY": self.storage_secret_access_key,
            "FUSETUNE_STORAGE_PART_BYTES": str(self.storage_part_bytes),
            "FUSETUNE_STORAGE_MAX_RETRIES": str(self.storage_max_retries),
            "FUSETUNE_STORAGE_RETRY_TIMEOUT_S": str(self.storage_retry_timeout_s),
            "FUSETUNE_STORAGE_CONNECT_TIMEOUT_S": str(self.storage_connect_timeout_s),
            "FUSETUNE_STORAGE_PRESIGNED_DOWNLOADS": str(self.storage_presigned_downloads).lower(),
            "FUSETUNE_STORAGE_PRESIGNED_EXPIRY_S": str(self.storage_presigned_expiry_s),
            "FUSETUNE_STORAGE_PUBLIC_ENDPOINT": self.storage_public_endpoint,
            "FUSETUNE_RAY_ADDRESS": self.ray_address,
            "FUSETUNE_RAY_PYTHON": self.ray_python,
            "FUSETUNE_MLFLOW_TRACKING_URI": self.mlflow_tracking_uri,
            "FUSETUNE_SERVING": str(self.serving).lower(),
            "FUSETUNE_SERVING_HOST": self.serving_host,
            "FUSETUNE_SERVING_PORT": str(self.serving_port),
            "FUSETUNE_SERVING_PUBLIC_HOST": self.serving_public_host,
            "FUSETUNE_SERVING_IDLE_S": str(self.serving_idle_s),
            "FUSETUNE_SERVING_MAX_BATCH": str(self.serving_max_batch),
            "FUSETUNE_SERVING_MAX_LEN": str(self.serving_max_len),
            "FUSETUNE_PYTHON_GRADERS": str(self.python_graders).lower(),
            "FUSETUNE_PYTHON_GRADER_TIMEOUT_S": str(self.python_grader_timeout_s),
            "FUSETUNE_PYTHON_GRADER_MEMORY_BYTES": str(self.python_grader_memory_bytes),
            "FUSETUNE_PYTHON_GRADER_FILE_BYTES": str(self.python_grader_file_bytes),
            **(
                {"FUSETUNE_PYTHON_GRADER_PROCESSES": str(self.python_grader_processes)}
                if self.python_grader_processes is not None
                else {}
            ),
        }
