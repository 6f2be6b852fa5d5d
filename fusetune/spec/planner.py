"""The memory planner: for a job and the GPU it lands on, the fastest memory plan that fits.

`plan_run` is its one entry point for a job about to be admitted or to train: the plan, the disk its checkpoints
need and the refusal, asked by the API with the configured memory and by the worker with what is free.

`plan_job` enumerates the plans the job allows (every part its hyperparameters pin stays as pinned: a
non-null `micro_batch_size`, `recompute_layers`, `offload_layers`, `optimizer_in_backward` or
`optimizer_state_on_host`, a `precision` other than "auto", `gradient_checkpointing: true` as every layer
recomputed), estimates each one's peak with the
memory model (fusetune/spec/estimate.py), ranks those that fit by the step time of `TIME_COSTS`' model, and
returns the fastest. When none fits, it says what would: more GPUs under FSDP, LoRA, a shorter max_seq_length,
each with the plan and peak it would run with. With no memory size to fit (a CPU, or a server that does not know
its GPUs' memory) the plan is the plainest the pins allow, at the trainer's default micro-batch; on a CPU
"auto" precision is fp32 and nothing is offloaded.

Offloaded and recomputed layers are distinct: at most L - recompute_layers layers offload, and no more than
`HOST_MEMORY_FOR_OFFLOAD_PER_GPU` of pinned host memory holds their activations, and the optimizer's state when
the plan keeps it there.

The time model is deliberately small; its constants live in `TimeCosts`, each with the H100 measurement it was
fitted to (a plan's step time comes out within about 10% of those measured). Only the ranking matters: every
plan of a job trains the same tokens per step.
- A micro-batch of t tokens runs its matmuls at `achieved_flops * t / (t + half_rate_tokens)` and costs a
  fixed `micro_batch_overhead_s` (launches, the loss's chunks): larger micro-batches are faster, less and less so.
  A mode whose linear layers compute in float8 runs their FLOPs at `float8_linear_time_factor` of the time
  (attention and the output layer stay bf16).
- A recomputed layer runs its forward again: a third of its forward + backward.
- An offloaded layer's activations cross the host link twice (out in the forward, back in the backward) at
  `host_link_bytes_per_s`; the copies hide behind `offload_overlap` of that pass's compute, the rest is exposed.
- The optimizer step streams weights, gradients and state through GPU memory; the 8-bit state's
  dequantize/requantize costs `eight_bit_step_overhead` more.
- The step inside the backward costs nothing more or less, but needs one micro-batch per step per GPU.
- The optimizer's state in host memory crosses the host link twice a step (in and out), in the open.
Ties (equal time) go to the plainer plan: the state on the GPU, the step after the backward, no offload, no
recompute.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fusetune.spec.estimate import (
    DataCounts,
    Estimate,
    ModelShape,
    checkpoint_bytes,
    checkpoints_on_disk,
    default_micro_batch_size,
    disk_refusal,
    estimate_job,
    lora_parameter_count,
    optimizer_state_bytes,
    row_tokens,
    saved_bytes_per_token_layer,
    saves_before_the_end,
    sequences_per_gpu,
)
from fusetune.spec.hyperparameters import LoraSpec, SpecError
from fusetune.spec.job import JobSpec
from fusetune.spec.methods import METHODS
from fusetune.spec.plan import MemoryPlan
from fusetune.spec.precision import (
    AUTO,
    DTYPE_BYTES,
    OPTIMIZERS,
    PRECISIONS,
    auto_precisions,
    mode_for,
    same_compute,
)


@dataclass(frozen=True)
class TimeCosts:
    """The time model's constants, measured on one H100 80 GB (benchmarks/step/memory_plans.py,
    benchmarks/results/h100-step.json, section memory-plans; Llama-3.1-8B shape, 8 x 8192)."""

    # FLOP/s a training step reaches at a large micro-batch, as this model counts FLOPs (6 x layer parameters +
    # 12 x attention width x row length per token and layer): 8-bit state, no recompute, 5.79 s a step.
    achieved_flops: float = 650e12
    # Tokens per micro-batch at which the matmuls run at half that rate (small micro-batches leave the tensor
    # cores waiting on memory and launches).
    half_rate_tokens: int = 512
    # Fixed time of one micro-batch's forward and backward outside the matmuls (launches, the loss's chunks).
    micro_batch_overhead_s: float = 2e-3
    # A recomputed layer's extra forward, as a share of its forward + backward (measured: 8 recomputed layers
    # added 476 ms to a 6.54 s step of 32 layers, 0.29 of a layer's share).
    recompute_fraction: float = 1 / 3
    # The float8 modes' linear layers, time per FLOP against bf16's: fp8-8bit ran 8 x 8192 (Llama-3.1-8B shape,
    # no recompute) in 4,546 ms against bf16-sr-8bit's 5,790 (h100-step.json, memory-plans-8b-fp8 and
    # memory-plans), which this model gives at 0.70.
    float8_linear_time_factor: float = 0.70
    # GPU <-> pinned host memory, bytes/s each way. Measured as the optimizer state crosses it: the 24 GiB plan
    # (1 x 2048, state in host memory, 16.3 GB of 8-bit state in and out a step) took 883 ms, of which this
    # model puts 250 ms (scaled by its 8% error on the plain 8B plan) in compute, leaving 50 GB/s
    # (h100-step.json, memory-plans-24gib).
    host_link_bytes_per_s: float = 50e9
    # Share of a pass's compute that offloaded activations' copies hide behind (the copies back start only one
    # layer ahead of the backward). Fitted to 12 layers offloaded at micro-batch 2 of 8 x 8192 rows
    # (bf16-sr-8bit, 2 recomputed: 1.35x the plain plan's step, h100-step.json, memory-plans), which 0.1 gives
    # at 1.36x. The fp8 point, 8 layers offloaded at micro-batch 2 of 8 x 4096 (1.61x, memory-plans-time-model),
    # ran those layers eager, their float8 casts unfused; they compile now. An earlier value of 0.6, at half
    # this link rate, rated micro-batch 4 with 4 layers offloaded the fastest plan for Qwen2.5-7B's shape, 8 x
    # 8192 fp8-8bit, on an H200: that service job ran at 9,548 tokens/s (a call whose results file did not come
    # back, only its log), where the same job on an H100, micro-batch 1 without offload, ran at 15,220
    # (h100-service.json, jobs-qwen7b).
    offload_overlap: float = 0.1
    # GPU memory bandwidth the optimizer step streams at (ANCHORS.md: 3012 GB/s copy bandwidth on an H100).
    memory_bytes_per_s: float = 3.0e12
    # The 8-bit optimizer's dequantize and requantize, as a share of the same step with unquantized state.
    eight_bit_step_overhead: float = 0.05


TIME_COSTS = TimeCosts()
# The share of a GPU's free memory a plan's estimated peak may take: the allocator's fragmentation and late
# allocations need several percent beyond the estimate. At 8 x 16384 (Llama-3.1-8B shape, fp8-8bit, one H100) a
# plan estimated at 73.9 GiB ran out of memory with 79.1 GiB allowed (75.3 GiB allocated and 3.1 GiB reserved
# but unused at the failure); one estimated at 71.3 GiB ran, 72.6 GiB allocated and 75.0 reserved at its peak
# (h100-step.json, memory-plans-16k-fp8 and -r18). Reserved memory reached 1.10x the estimate with 8 layers
# offloaded (memory-plans-time-model).
PLANNABLE_FRACTION = 0.93
# Whether the planner chooses the optimizer step inside the backward for a job of several GPUs (a pin is passed
# through either way, and the trainer refuses what it cannot run).
OPTIMIZER_IN_BACKWARD_ON_SEVERAL_GPUS = False
# Pinned host memory that one GPU's offloaded activations (and optimizer state, when a plan keeps it there) may
# take: the 8-GPU hosts have 560 GiB for 8 GPUs, the one-GPU hosts 128 GiB; pinned pages cannot be swapped, so
# leave the rest to the data, the loaders and the OS.
HOST_MEMORY_FOR_OFFLOAD_PER_GPU = 32 * 2**30
# A refusal names the fastest plan within this much of the least memory any plan needs.
SMALLEST_PLAN_SLACK_BYTES = 256 * 2**20
# The GPU counts tried, in order, by a refusal's FSDP alternative.
FSDP_ALTERNATIVE_GPUS = (2, 4, 8)
# The shortest max_seq_length a refusal's alternative suggests (halving from the job's).
SHORTEST_ALTERNATIVE_SEQ_LENGTH = 256


class PlanError(SpecError):
    """A pinned part of the plan that the model cannot run (more layers than it has); `field` names it."""


@dataclass(frozen=True)
class Alternative:
    """A change to the job under which a plan fits, with that plan and its peak."""

    change: str  # "n_gpus 2 with distributed fsdp"
    hyperparameters: dict[str, Any]  # the hyperparameters it changes, as a request would send them
    plan: MemoryPlan
    peak_memory_bytes_per_gpu: int

    def as_dict(self) -> dict[str, Any]:
        return {"change": self.change, "hyperparameters": self.hyperparameters, "plan": self.plan.as_dict(),
                "plan_description": self.plan.describe(),
                "peak_memory_bytes_per_gpu": self.peak_memory_bytes_per_gpu}  # fmt: skip


@dataclass(frozen=True)
class PlannedJob:
    """The plan chosen for a job: the fastest that fits `memory_bytes` (None: no limit known, the fastest), or,
    when none fits, the one of least memory, with `alternatives` that would fit."""

    plan: MemoryPlan
    estimate: Estimate
    step_time_s: float
    memory_bytes: int | None
    fits: bool | None
    alternatives: tuple[Alternative, ...] = ()

    def refusal(self) -> str:
        peak, memory = self.estimate.peak_memory_bytes_per_gpu, self.memory_bytes or 0
        text = (
            f"The job needs about {peak / 2**30:.1f} GiB per GPU even with its smallest plan "
            f"({self.plan.describe()}), more than the {memory / 2**30:.1f} GiB a GPU has for it."
        )
        if not self.alternatives:
            return (
                f"{text} Use a smaller model, a shorter max_seq_length, or more GPUs with distributed fsdp."
            )
        options = "; ".join(
            f"{a.change} ({a.plan.describe()}: {a.peak_memory_bytes_per_gpu / 2**30:.1f} GiB per GPU)"
            for a in self.alternatives
        )
        return f"{text} It would fit with: {options}."


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class _StepModel:
    """The time model's view of one job: FLOPs and bytes that do not depend on the plan."""

    layer_flops_per_token: float  # forward + backward of one decoder layer
    layer_linear_flops_per_token: float  # the part of it in the linear layers (what float8 speeds up)
    other_flops_per_token: float  # the output layer and loss
    saved_bytes_per_token_layer: dict[str, int]  # by precision
    trained_parameters: int
    micro_tokens_per_sequence: int
    sequences_per_gpu: int
    layers: int

    @classmethod
    def of(cls, shape: ModelShape, job: JobSpec, data: DataCounts, precisions: list[str]) -> _StepModel:
        hyper = job.hyperparameters
        seq = row_tokens(job, data)
        h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        linear = 6.0 * shape.layer_parameter_count()
        layer = linear + 12.0 * q * seq
        if hyper.lora is not None:
            trained = lora_parameter_count(shape, hyper.lora.r, hyper.lora.target_modules)
        else:
            trained = shape.parameter_count()
        saved = {
            name: saved_bytes_per_token_layer(
                h, q, kv, shape.intermediate_size, hyper.kernels, mode_for(name).weight_dtype == "bfloat16"
            )
            for name in precisions
        }
        return cls(
            layer_flops_per_token=layer,
            layer_linear_flops_per_token=linear,
            other_flops_per_token=6.0 * shape.vocab_size * h,
            saved_bytes_per_token_layer=saved,
            trained_parameters=trained // (hyper.n_gpus if hyper.distributed == "fsdp" else 1),
            micro_tokens_per_sequence=seq * METHODS[job.method.type].rows_per_example,
            sequences_per_gpu=sequences_per_gpu(job),
            layers=shape.num_layers,
        )

    def step_time_s(self, plan: MemoryPlan, costs: TimeCosts) -> float:
        tokens = plan.micro_batch_size * self.micro_tokens_per_sequence
        rate = costs.achieved_flops * tokens / (tokens + costs.half_rate_tokens)
        mode = mode_for(plan.precision)
        layer_flops = self.layer_flops_per_token
        if mode.float8_linears:
            layer_flops -= (1 - costs.float8_linear_time_factor) * self.layer_linear_flops_per_token
        layer_s = tokens * layer_flops / rate
        compute_s = self.layers * layer_s + tokens * self.other_flops_per_token / rate
        recompute_s = plan.recompute_layers * costs.recompute_fraction * layer_s
        # The forward is a third of the compute, the backward (with the recomputation) the rest.
        forward_s, backward_s = compute_s / 3, compute_s * 2 / 3 + recompute_s
        copy_s = plan.offload_layers * tokens * self.saved_bytes_per_token_layer[plan.precision]
        copy_s /= costs.host_link_bytes_per_s
        exposed_s = max(0.0, copy_s - costs.offload_overlap * forward_s) + max(
            0.0, copy_s - costs.offload_overlap * backward_s
        )
        micro_s = forward_s + backward_s + exposed_s + costs.micro_batch_overhead_s
        optimizer = OPTIMIZERS[mode.optimizer]
        # Weight read and written, gradient read, each state read and written (as if in the weights' dtype).
        step_bytes = 3 * mode.weight_bytes + 2 * optimizer.states_per_parameter * mode.weight_bytes
        optimizer_s = self.trained_parameters * step_bytes / costs.memory_bytes_per_s
        if optimizer.state_dtype is not None and DTYPE_BYTES[optimizer.state_dtype] < mode.weight_bytes:
            optimizer_s *= 1 + costs.eight_bit_step_overhead
        if plan.optimizer_state_on_host:
            # The whole state in and out over the host link, queued with the updates (nothing hides it).
            state_bytes = self.trained_parameters * optimizer.state_bytes_per_parameter(mode.weight_dtype)
            optimizer_s += 2 * state_bytes / costs.host_link_bytes_per_s
        return self.sequences_per_gpu // plan.micro_batch_size * micro_s + optimizer_s


def step_time_s(
    shape: ModelShape, job: JobSpec, data: DataCounts, plan: MemoryPlan, costs: TimeCosts = TIME_COSTS
) -> float:
    """The time model's seconds per optimizer step of `job` under `plan` (what the planner ranks plans by)."""
    return _StepModel.of(shape, job, data, [plan.precision]).step_time_s(plan, costs)


def _choices(shape: ModelShape, job: JobSpec, on_gpu: bool, memory_known: bool):
    """(precisions, micro-batches, optimizer_in_backward values, optimizer_state_on_host values, recompute
    counts, offload count or None) the job's pins allow. Raises PlanError for a pin the model cannot run."""
    hyper, layers = job.hyperparameters, shape.num_layers
    fsdp = hyper.distributed == "fsdp" and hyper.n_gpus > 1
    if hyper.precision != AUTO:
        precisions = [hyper.precision]
    else:
        # What "auto" may become on this kind of device (the precision table says); FSDP2 runs only some.
        precisions = [
            p
            for p in auto_precisions(on_gpu)
            if not fsdp or OPTIMIZERS[PRECISIONS[p].optimizer].supports_fsdp
        ]
    per_gpu = sequences_per_gpu(job)
    if hyper.micro_batch_size is not None:
        micros = [hyper.micro_batch_size]
    elif memory_known or hyper.optimizer_in_backward:
        micros = _divisors(per_gpu)[::-1]
    else:
        # Nothing to fit (a CPU, a server that does not know its GPUs): the trainer's default micro-batch.
        micros = [default_micro_batch_size(per_gpu, hyper.max_seq_length)]
    if hyper.optimizer_in_backward is not None:
        in_backward = [hyper.optimizer_in_backward]
    else:
        in_backward = [False, True] if hyper.n_gpus == 1 or OPTIMIZER_IN_BACKWARD_ON_SEVERAL_GPUS else [False]
    if hyper.optimizer_state_on_host is not None:
        on_host = [hyper.optimizer_state_on_host]
    else:
        # Pinned host memory and the staging copies are a GPU's; FSDP shards the state instead.
        on_host = [False, True] if on_gpu and memory_known and not fsdp else [False]
    if hyper.recompute_layers is not None:
        if hyper.recompute_layers > layers:
            raise PlanError(
                "hyperparameters.recompute_layers",
                f"hyperparameters.recompute_layers ({hyper.recompute_layers}) is more than the model's "
                f"{layers} decoder layers.",
            )
        if hyper.gradient_checkpointing and hyper.recompute_layers != layers:
            raise PlanError(
                "hyperparameters.recompute_layers",
                f"hyperparameters.gradient_checkpointing recomputes all {layers} decoder layers, but "
                f"recompute_layers is {hyper.recompute_layers}: give one of them.",
            )
        recomputes = [hyper.recompute_layers]
    else:
        recomputes = [layers] if hyper.gradient_checkpointing else list(range(layers + 1))
    offload = hyper.offload_layers
    if offload is None and not on_gpu:
        offload = 0  # pinned host memory and a side stream are a GPU's
    if offload is not None and offload + min(recomputes) > layers:
        raise PlanError(
            "hyperparameters.offload_layers",
            f"hyperparameters.offload_layers ({offload}) and the {min(recomputes)} recomputed layers are more "
            f"than the model's {layers} decoder layers (a layer is recomputed or offloaded, not both).",
        )
    return precisions, micros, in_backward, on_host, recomputes, offload


def plan_job(
    shape: ModelShape,
    job: JobSpec,
    data: DataCounts,
    memory_bytes: int | None,
    *,
    on_gpu: bool = True,
    measured_tokens_per_second: float | None = None,
    costs: TimeCosts = TIME_COSTS,
    host_memory_bytes: int = HOST_MEMORY_FOR_OFFLOAD_PER_GPU,
    alternatives: bool = True,
) -> PlannedJob:
    """The fastest plan for `job` (on `job.hyperparameters.n_gpus` GPUs of `memory_bytes` each; None: no
    limit known) that fits; when none does, the plan of least memory, not fitting, with the alternatives that
    would fit (unless `alternatives` is False). Raises PlanError for a pin the model cannot run."""
    precisions, micros, in_backward, on_host, recomputes, pinned_offload = _choices(
        shape, job, on_gpu, memory_bytes is not None
    )
    per_gpu, layers = sequences_per_gpu(job), shape.num_layers
    model = _StepModel.of(shape, job, data, precisions)

    @functools.cache  # the search asks for the same plan more than once
    def estimate(plan: MemoryPlan) -> Estimate:
        return estimate_job(
            shape, job, data, plan=plan, measured_tokens_per_second=measured_tokens_per_second
        )

    def peak(plan: MemoryPlan) -> int:
        return estimate(plan).peak_memory_bytes_per_gpu

    def fits(plan: MemoryPlan) -> bool:
        return memory_bytes is None or peak(plan) <= memory_bytes * PLANNABLE_FRACTION

    def most_offload(plan: MemoryPlan) -> int:
        """The most layers of `plan` that may offload within `host_memory_bytes`."""
        room = layers - plan.recompute_layers
        if room == 0:
            return 0
        one = estimate(dataclasses.replace(plan, offload_layers=1))
        host_room = max(0, host_memory_bytes - one.host_optimizer_state_bytes)
        per_layer = one.host_activation_bytes
        return min(room, host_room // per_layer) if per_layer else room

    def rank(plan: MemoryPlan) -> tuple:
        plainness = (
            plan.optimizer_state_on_host,
            plan.optimizer_in_backward,
            plan.offload_layers,
            plan.recompute_layers,
        )
        return (model.step_time_s(plan, costs), *plainness)

    def least_memory(bound: MemoryPlan) -> list[MemoryPlan]:
        """For each recompute count, `bound` with the most offload: memory only falls with more offload."""
        plans = [dataclasses.replace(bound, recompute_layers=recompute) for recompute in recomputes]
        offloads = [pinned_offload if pinned_offload is not None else most_offload(plan) for plan in plans]
        return [dataclasses.replace(plan, offload_layers=o) for plan, o in zip(plans, offloads, strict=True)]

    # Memory grows with the micro-batch: a precision and step placement that does not fit at its smallest
    # micro-batch, with everything recomputed or offloaded that may be, fits at none.
    # The state goes to host memory only for an optimizer that can stage it, and only if the host has the room.
    def host_state_allowed(precision: str, host: bool) -> bool:
        if not host:
            return True
        plan = MemoryPlan(min(micros), 0, 0, precision, False, optimizer_state_on_host=True)
        supported = OPTIMIZERS[mode_for(precision).optimizer].supports_host_state
        return supported and optimizer_state_bytes(shape, job, plan)[1] <= host_memory_bytes

    groups = [
        (precision, backward, host, [m for m in micros if not backward or m == per_gpu])
        for precision in precisions
        for backward in in_backward
        for host in on_host
        if host_state_allowed(precision, host)
    ]
    if on_host == [True] and not groups:
        raise PlanError(
            "hyperparameters.optimizer_state_on_host",
            "hyperparameters.optimizer_state_on_host: the optimizer's state does not fit the "
            f"{host_memory_bytes / 2**30:.0f} GiB of pinned host memory a GPU may take, or its optimizer cannot "
            "keep it there.",
        )
    groups = [group for group in groups if group[-1]]
    if not groups:
        raise PlanError(
            "hyperparameters.micro_batch_size",
            "hyperparameters.optimizer_in_backward needs one micro-batch per step on each GPU (no gradient "
            f"accumulation): micro_batch_size must be batch_size / n_gpus = {per_gpu}, not {micros[0]}.",
        )
    smallest_plans = [
        plan
        for precision, backward, host, allowed in groups
        for plan in least_memory(MemoryPlan(min(allowed), 0, 0, precision, backward, host))
    ]
    fitting = {
        (plan.precision, plan.optimizer_in_backward, plan.optimizer_state_on_host)
        for plan in smallest_plans
        if fits(plan)
    }
    # Each (precision, micro-batch, step placement) with its fastest conceivable plan (nothing recomputed or
    # offloaded that is not pinned), fastest first: once that bound is slower than the best plan found, nothing
    # after it can win.
    combos = sorted(
        (
            (rank(bound), bound)
            for precision, backward, host, allowed in groups
            if (precision, backward, host) in fitting
            for micro in allowed
            for bound in [MemoryPlan(micro, min(recomputes), pinned_offload or 0, precision, backward, host)]
        ),
        key=lambda item: item[0],
    )
    best: tuple[tuple, MemoryPlan] | None = None
    for bound_rank, bound in combos:
        if best is not None and bound_rank >= best[0]:
            break
        for recompute in recomputes:
            # More recompute is never faster: once even no offload at this count is slower, stop.
            if best is not None and rank(dataclasses.replace(bound, recompute_layers=recompute)) >= best[0]:
                break
            candidate = _least_offload(bound, recompute, pinned_offload, most_offload, fits)
            if candidate is not None and (best is None or rank(candidate) < best[0]):
                best = (rank(candidate), candidate)
    if best is not None:
        plan = best[1]
        return PlannedJob(
            plan, estimate(plan), best[0][0], memory_bytes, None if memory_bytes is None else True
        )

    # Nothing fits: the plan of least memory (the fastest of those within SMALLEST_PLAN_SLACK_BYTES of it, so
    # that a few kilobytes do not name a slower plan), and what would make the job fit.
    least = min(peak(plan) for plan in smallest_plans)

    def near_least(plan: MemoryPlan) -> bool:
        return peak(plan) <= least + SMALLEST_PLAN_SLACK_BYTES

    near = [
        _least_offload(plan, plan.recompute_layers, pinned_offload, most_offload, near_least)
        for plan in smallest_plans
    ]
    smallest = min((plan for plan in near if plan is not None), key=rank)
    found = _alternatives(shape, job, data, memory_bytes, on_gpu, costs) if alternatives else ()
    return PlannedJob(
        smallest, estimate(smallest), model.step_time_s(smallest, costs), memory_bytes, False, found
    )


def _least_offload(
    bound: MemoryPlan, recompute: int, pinned: int | None, most_offload, fits
) -> MemoryPlan | None:
    """The plan of `bound` with `recompute` layers recomputed and the fewest offloaded layers that fits (the
    pinned count, when pinned), or None. GPU memory never rises with more layers offloaded, so a bisection finds
    it, up to what the host memory allows."""
    plan = dataclasses.replace(bound, recompute_layers=recompute)
    if pinned is not None:
        plan = dataclasses.replace(plan, offload_layers=pinned)
        return plan if fits(plan) else None
    low, high = 0, most_offload(plan)
    if not fits(dataclasses.replace(plan, offload_layers=high)):
        return None
    while low < high:
        middle = (low + high) // 2
        if fits(dataclasses.replace(plan, offload_layers=middle)):
            high = middle
        else:
            low = middle + 1
    return dataclasses.replace(plan, offload_layers=low)


def _changed(job: JobSpec, **changes: Any) -> JobSpec:
    return job.model_copy(update={"hyperparameters": job.hyperparameters.model_copy(update=changes)})


def _alternatives(
    shape: ModelShape,
    job: JobSpec,
    data: DataCounts,
    memory_bytes: int | None,
    on_gpu: bool,
    costs: TimeCosts,
) -> tuple[Alternative, ...]:
    """The first change of each kind that makes the job fit: fused kernels on, more GPUs under FSDP, a pinned
    precision's smaller optimizer state, LoRA, a shorter max_seq_length; each with the plan it would run with."""
    hyper = job.hyperparameters
    tried: list[tuple[str, dict[str, Any], JobSpec, DataCounts]] = []
    if not hyper.kernels:
        tried.append(("kernels on", {"kernels": True}, _changed(job, kernels=True), data))
    for n_gpus in (n for n in FSDP_ALTERNATIVE_GPUS if n > hyper.n_gpus):
        batch_size = -(-hyper.batch_size // n_gpus) * n_gpus
        changes: dict[str, Any] = {"n_gpus": n_gpus, "distributed": "fsdp"}
        if batch_size != hyper.batch_size:
            changes["batch_size"] = batch_size
        precision = hyper.precision
        if precision != AUTO and not OPTIMIZERS[PRECISIONS[precision].optimizer].supports_fsdp:
            # The same compute with an optimizer FSDP2 runs (fp8-8bit -> fp8), else the default.
            sharded = [m.name for m in same_compute(precision) if OPTIMIZERS[m.optimizer].supports_fsdp]
            changes["precision"] = sharded[0] if sharded else AUTO
        micro = hyper.micro_batch_size
        if micro is not None and (batch_size // n_gpus) % micro:
            changes["micro_batch_size"] = None
        if hyper.optimizer_in_backward and not OPTIMIZER_IN_BACKWARD_ON_SEVERAL_GPUS:
            changes["optimizer_in_backward"] = None
        name = " and ".join(f"{key} {'auto' if value is None else value}" for key, value in changes.items())
        tried.append((name, changes, _changed(job, **changes), data))
    if hyper.precision != AUTO:
        # A pinned precision's smaller optimizer state, the compute unchanged (fp8 -> fp8-8bit); "auto" plans
        # over the state's precision itself.
        smallest = min(same_compute(hyper.precision), key=lambda m: m.optimizer_state_bytes, default=None)
        if smallest and smallest.optimizer_state_bytes < PRECISIONS[hyper.precision].optimizer_state_bytes:
            changed = _changed(job, precision=smallest.name)
            tried.append((f"precision {smallest.name}", {"precision": smallest.name}, changed, data))
    if hyper.lora is None:
        lora = LoraSpec(r=16, target_modules="all-linear")
        tried.append(("LoRA (r=16)", {"lora": lora.model_dump()}, _changed(job, lora=lora), data))
    length = hyper.max_seq_length // 2
    while length >= SHORTEST_ALTERNATIVE_SEQ_LENGTH:
        shorter = dataclasses.replace(
            data, padded_length=min(data.padded_length, length) if data.padded_length else None
        )
        tried.append(
            (
                f"max_seq_length {length}",
                {"max_seq_length": length},
                _changed(job, max_seq_length=length),
                shorter,
            )
        )
        length //= 2
    found: dict[str, Alternative] = {}
    for name, changes, changed, changed_data in tried:
        kind = next(iter(changes))  # kernels, n_gpus, precision, lora or max_seq_length
        if kind in found:
            continue
        try:
            planned = plan_job(
                shape, changed, changed_data, memory_bytes, on_gpu=on_gpu, costs=costs, alternatives=False
            )
        except PlanError:
            continue
        if planned.fits:
            found[kind] = Alternative(name, changes, planned.plan, planned.estimate.peak_memory_bytes_per_gpu)
    return tuple(found.values())


@dataclass(frozen=True)
class CheckpointDisk:
    """The disk a job's checkpoints take at most, and whether the free space holds it (None: not known)."""

    checkpoint_bytes: int
    checkpoints_on_disk: int
    needed_bytes: int
    free_bytes: int | None

    @property
    def fits(self) -> bool | None:
        return None if self.free_bytes is None else self.needed_bytes <= self.free_bytes

    def refusal(self) -> str | None:
        if self.free_bytes is None:
            return None
        return disk_refusal(
            self.needed_bytes, self.free_bytes, self.checkpoint_bytes, self.checkpoints_on_disk
        )


def checkpoint_disk(
    shape: ModelShape,
    job: JobSpec,
    plan: MemoryPlan,
    keep_last_checkpoints: int,
    free_bytes: int | None,
    checkpoints_present: int = 0,
    periodic: bool = True,
) -> CheckpointDisk:
    """The disk for `keep_last_checkpoints` checkpoints of the job under `plan` (its precision sets the
    optimizer state's bytes), less the `checkpoints_present` already on that disk (a resumed run's). A run that
    saves nothing before its end (`periodic` False, estimate.saves_before_the_end) writes one more: its final
    checkpoint, beside those present until it is whole."""
    size = checkpoint_bytes(shape, job, plan.precision)
    if not periodic:
        return CheckpointDisk(size, 1 + min(checkpoints_present, keep_last_checkpoints), size, free_bytes)
    count = checkpoints_on_disk(keep_last_checkpoints)
    return CheckpointDisk(size, count, size * max(0, count - checkpoints_present), free_bytes)


@dataclass(frozen=True)
class CheckpointSaving:
    """How a run saves its checkpoints (the server's schedule, or the run's config) and the disk they go to."""

    keep_last_checkpoints: int
    every_steps: int | None
    every_epoch: bool
    every_minutes: float | None
    free_bytes: int | None  # None: not known
    checkpoints_present: int = 0  # a resumed run's, already on that disk


@dataclass(frozen=True)
class Refusal:
    """Why a job cannot run: no plan fits the memory ("memory"), or its checkpoints do not fit the disk."""

    kind: Literal["memory", "disk"]
    message: str


@dataclass(frozen=True)
class RunDecision:
    """What a job will run with: the plan chosen (with its estimate and alternatives), the disk its checkpoints
    need, and the refusal when it cannot run (None when it can)."""

    planned: PlannedJob
    disk: CheckpointDisk
    refusal: Refusal | None

    @property
    def plan(self) -> MemoryPlan:
        return self.planned.plan


def plan_run(
    shape: ModelShape,
    job: JobSpec,
    data: DataCounts,
    memory_bytes: int | None,
    saving: CheckpointSaving,
    *,
    on_gpu: bool = True,
    measured_tokens_per_second: float | None = None,
) -> RunDecision:
    """The one answer to "what will this job run?": the plan (`plan_job`), then the disk its checkpoints need
    (one final checkpoint when it saves nothing before its end), then the refusal, memory before disk. The API's
    admission asks it with the configured GPU memory, the worker with what is free on its devices. Raises
    PlanError for a pin the model cannot run."""
    planned = plan_job(
        shape, job, data, memory_bytes, on_gpu=on_gpu, measured_tokens_per_second=measured_tokens_per_second
    )
    periodic = saves_before_the_end(job, saving.every_steps, saving.every_epoch, saving.every_minutes)
    disk = checkpoint_disk(
        shape, job, planned.plan, saving.keep_last_checkpoints, saving.free_bytes,
        saving.checkpoints_present, periodic,
    )  # fmt: skip
    refusal = None
    if planned.fits is False:
        refusal = Refusal("memory", planned.refusal())
    elif (disk_refusal_text := disk.refusal()) is not None:
        refusal = Refusal("disk", disk_refusal_text)
    return RunDecision(planned, disk, refusal)


def free_disk_bytes(path: str | Path) -> int:
    """Free space on the disk that holds `path` (or would: its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free
