"""The memory planner: every pin honoured, the fastest plan that fits chosen, a refusal that names a plan that
fits, and the disk the checkpoints need."""

import dataclasses
import itertools
import math

import pytest

from fusetune.spec import precision as precision_table
from fusetune.spec.estimate import (
    DataCounts,
    ModelShape,
    checkpoint_bytes,
    estimate_job,
    saved_bytes_per_token_layer,
    saves_before_the_end,
)
from fusetune.spec.hyperparameters import HyperparametersRequest, JobHyperparameters, SpecError
from fusetune.spec.job import JobSpec
from fusetune.spec.plan import MemoryPlan
from fusetune.spec.planner import (
    PLANNABLE_FRACTION,
    TIME_COSTS,
    PlanError,
    _choices,
    checkpoint_disk,
    plan_job,
    step_time_s,
)

GIB = 2**30
LLAMA_8B = ModelShape(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, vocab_size=128256, tied_embeddings=False)  # fmt: skip
# Four layers, so that every plan can be enumerated; the shape of a 1B model's layer.
SMALL = ModelShape(hidden_size=2048, intermediate_size=8192, num_layers=4, num_heads=32, num_kv_heads=8,
                   head_dim=64, vocab_size=32000, tied_embeddings=True)  # fmt: skip


def _job(**hyperparameters) -> JobSpec:
    return JobSpec(
        hyperparameters=JobHyperparameters(**{"batch_size": 8, "max_seq_length": 8192, **hyperparameters})
    )


def _data(seq: int = 8192) -> DataCounts:
    return DataCounts(example_count=64, token_estimate=64 * seq, padded_length=seq)


def _peak(shape, job, data, plan) -> int:
    return estimate_job(shape, job, data, plan=plan).peak_memory_bytes_per_gpu


def _every_plan(shape: ModelShape, job: JobSpec):
    layers, per_gpu = shape.num_layers, job.hyperparameters.batch_size // job.hyperparameters.n_gpus
    for precision, micro, backward, host, recompute in itertools.product(
        ("bf16-sr", "bf16-sr-8bit"), (1, 2, 4, 8), (False, True), (False, True), range(layers + 1)
    ):
        if micro <= per_gpu and per_gpu % micro == 0 and (not backward or micro == per_gpu):
            for offload in range(layers - recompute + 1):
                yield MemoryPlan(micro, recompute, offload, precision, backward, optimizer_state_on_host=host)


def test_the_fastest_plan_that_fits_is_chosen():
    """Against every plan of a 4-layer model, at memory sizes from roomy to tight: the chosen plan fits and no
    plan that fits is faster."""
    job, data = _job(max_seq_length=4096), _data(4096)
    plans = list(_every_plan(SMALL, job))
    peaks = {plan: _peak(SMALL, job, data, plan) for plan in plans}
    times = {plan: step_time_s(SMALL, job, data, plan) for plan in plans}
    chosen_kinds = set()
    for memory in sorted(set(peaks.values()))[:: max(1, len(set(peaks.values())) // 40)]:
        planned = plan_job(SMALL, job, data, math.ceil(memory / PLANNABLE_FRACTION), host_memory_bytes=2**50)
        assert planned.fits and planned.estimate.peak_memory_bytes_per_gpu == peaks[planned.plan] <= memory
        fastest = min(times[plan] for plan in plans if peaks[plan] <= memory)
        assert times[planned.plan] == pytest.approx(fastest, rel=1e-12)
        chosen_kinds.add((planned.plan.precision, planned.plan.recompute_layers > 0,
                          planned.plan.offload_layers > 0, planned.plan.optimizer_in_backward))  # fmt: skip
    # The sweep went through plans of every kind, so the comparison above covered each.
    assert len(chosen_kinds) >= 4, chosen_kinds
    # With room to spare: the plainest, fastest plan.
    roomy = plan_job(SMALL, job, data, 80 * GIB)
    assert roomy.plan == MemoryPlan(8, 0, 0, "bf16-sr", False)


def test_what_auto_may_become_is_the_precision_tables_data(monkeypatch):
    """The planner chooses "auto" among the modes the precision table marks for the device, and nothing else:
    taking the 8-bit state's mark off the table takes it out of every plan."""
    assert precision_table.auto_precisions(on_gpu=True) == ("bf16-sr", "bf16-sr-8bit")
    assert precision_table.auto_precisions(on_gpu=False) == ("fp32",)
    assert (precision_table.GPU_DEFAULT, precision_table.CPU_DEFAULT) == ("bf16-sr", "fp32")
    job, data = _job(), _data()
    assert plan_job(SMALL, job, data, None, on_gpu=False).plan.precision == "fp32"
    # 8B at 8 x 8192 on 64 GiB: only the 8-bit state fits beside the bf16 weights and gradients.
    tight = plan_job(LLAMA_8B, job, data, 64 * GIB)
    assert tight.fits and tight.plan.precision == "bf16-sr-8bit"
    eight_bit = dataclasses.replace(precision_table.PRECISIONS["bf16-sr-8bit"], auto_on=())
    monkeypatch.setitem(precision_table.PRECISIONS, "bf16-sr-8bit", eight_bit)
    assert precision_table.auto_precisions(on_gpu=True) == ("bf16-sr",)
    assert plan_job(LLAMA_8B, job, data, 64 * GIB).plan.precision == "bf16-sr"


def test_the_time_model_ranks_the_costs_as_documented():
    job, data = _job(), _data()
    plain = MemoryPlan(1, 0, 0, "bf16-sr", False)
    base = step_time_s(LLAMA_8B, job, data, plain)
    every_layer = step_time_s(LLAMA_8B, job, data, dataclasses.replace(plain, recompute_layers=32))
    # Recomputing every layer costs about a third of the layers' forward + backward (the output layer and the
    # optimizer step take the rest of the step).
    assert 0.25 < (every_layer - base) / base < 1 / 3
    # An offloaded layer's activations cross the host link out and back; compute hides offload_overlap of each
    # pass's time, so 4 layers cost less than their crossings, and every layer past those is exposed in full.
    seconds_per_layer = 2 * 8 * 8192 * saved_bytes_per_token_layer(4096, 4096, 1024, 14336, True, True)
    seconds_per_layer /= TIME_COSTS.host_link_bytes_per_s  # out and back, 8 micro-batches
    four = step_time_s(LLAMA_8B, job, data, dataclasses.replace(plain, offload_layers=4)) - base
    assert 0 < four < 4 * seconds_per_layer
    every = step_time_s(LLAMA_8B, job, data, dataclasses.replace(plain, offload_layers=32)) - base
    assert every - four == pytest.approx(28 * seconds_per_layer, rel=1e-9)
    # Float8 linear layers take float8_linear_time_factor of the linear layers' time, attention's unchanged.
    fp8 = step_time_s(LLAMA_8B, job, data, dataclasses.replace(plain, precision="fp8"))
    assert 0.7 * base < fp8 < 0.85 * base
    eight_bit = step_time_s(LLAMA_8B, job, data, dataclasses.replace(plain, precision="bf16-sr-8bit"))
    assert base < eight_bit < base * 1.01
    # Larger micro-batches are faster, less and less so.
    times = [
        step_time_s(LLAMA_8B, job, data, dataclasses.replace(plain, micro_batch_size=m)) for m in (1, 2, 4, 8)
    ]
    assert times[0] > times[1] > times[2] > times[3] and times[0] - times[1] > times[2] - times[3]
    assert step_time_s(LLAMA_8B, job, data, MemoryPlan(8, 0, 0, "bf16-sr", True)) == times[3]


@pytest.mark.parametrize(
    "pins",
    [
        {"micro_batch_size": 4},
        {"recompute_layers": 5},
        {"offload_layers": 7},
        {"precision": "bf16-sr"},
        {"optimizer_in_backward": False},
        {"optimizer_in_backward": True},
        {"gradient_checkpointing": True},
        {"micro_batch_size": 1, "recompute_layers": 32, "precision": "bf16"},
    ],
)
def test_every_pin_is_honoured(pins):
    """An 8B model at 8,192 tokens on 80 GiB: the planner alone picks 8-bit state and no recompute at
    micro-batch 1 (the fastest plan measured on an H100, benchmarks/results/h100-step.json, section
    memory-plans); whatever a job pins stays pinned, and the rest is planned around it."""
    free = plan_job(LLAMA_8B, _job(), _data(), 80 * GIB)
    assert free.fits and free.plan == MemoryPlan(1, 0, 0, "bf16-sr-8bit", False)
    planned = plan_job(LLAMA_8B, _job(**pins), _data(), 80 * GIB)
    expected = {key: value for key, value in pins.items() if key in MemoryPlan.__dataclass_fields__}
    if pins.get("gradient_checkpointing"):
        expected["recompute_layers"] = 32
    if pins.get("optimizer_in_backward"):
        expected["micro_batch_size"] = 8  # no gradient accumulation
    assert {key: getattr(planned.plan, key) for key in expected} == expected
    # Each pin but the last placement is a value the planner would not have chosen by itself.
    assert planned.plan != free.plan or pins == {"optimizer_in_backward": False}
    if planned.fits:
        assert planned.estimate.peak_memory_bytes_per_gpu <= 80 * GIB * PLANNABLE_FRACTION


def test_pins_the_model_cannot_run_are_refused_naming_the_field():
    for pins, field in [
        ({"recompute_layers": 33}, "hyperparameters.recompute_layers"),
        ({"gradient_checkpointing": True, "recompute_layers": 3}, "hyperparameters.recompute_layers"),
        ({"recompute_layers": 30, "offload_layers": 3}, "hyperparameters.offload_layers"),
    ]:
        with pytest.raises(PlanError) as refused:
            plan_job(LLAMA_8B, _job(**pins), _data(), 80 * GIB)
        assert refused.value.field == field and "32 decoder layers" in str(refused.value)
    # gradient_checkpointing with the model's own layer count is the same thing said twice.
    same = plan_job(LLAMA_8B, _job(gradient_checkpointing=True, recompute_layers=32), _data(), 80 * GIB)
    assert same.plan.recompute_layers == 32


def test_without_a_memory_size_or_a_gpu_the_plan_is_the_plainest():
    # The trainer's default micro-batch: 16,384 tokens, two rows of 8,192.
    unknown = plan_job(LLAMA_8B, _job(), _data(), None)
    assert unknown.fits is None and unknown.plan == MemoryPlan(2, 0, 0, "bf16-sr", False)
    pinned = plan_job(LLAMA_8B, _job(optimizer_in_backward=True, gradient_checkpointing=True), _data(), None)
    assert pinned.plan == MemoryPlan(8, 32, 0, "bf16-sr", True)
    cpu = plan_job(SMALL, _job(max_seq_length=128), _data(100), None, on_gpu=False)
    assert cpu.plan == MemoryPlan(8, 0, 0, "fp32", False)
    pinned = plan_job(SMALL, _job(max_seq_length=128, recompute_layers=2, optimizer_in_backward=True), _data(100),
                      None, on_gpu=False)  # fmt: skip
    assert pinned.plan == MemoryPlan(8, 2, 0, "fp32", True)
    # On a CPU with a memory size (a test's), nothing is offloaded: recompute and smaller micro-batches instead.
    tight = plan_job(SMALL, _job(max_seq_length=4096), _data(4096), 8 * GIB, on_gpu=False)
    assert tight.fits and tight.plan.offload_layers == 0 and tight.plan.precision == "fp32"
    assert tight.plan != plan_job(SMALL, _job(max_seq_length=4096), _data(4096), None, on_gpu=False).plan


def test_when_nothing_fits_the_refusal_names_plans_that_fit():
    """An 8B full fine-tune at 8,192 tokens, batch 8, in 40 GiB: no plan fits one GPU (the weights, gradients and
    state alone are about 45 GiB, and the step inside the backward would hold 8 sequences at once). The refusal
    names what would fit, each with a plan that does fit when the job is changed so. (The optimizer state stays
    on the GPU, as pinned: in host memory it would fit, test_a_state_too_large_for_the_gpu_goes_to_host_memory.)"""
    job, data, memory = _job(optimizer_state_on_host=False), _data(), 40 * GIB
    planned = plan_job(LLAMA_8B, job, data, memory)
    assert planned.fits is False and planned.estimate.peak_memory_bytes_per_gpu > memory
    # The smallest plan is no larger than any other.
    assert all(planned.estimate.peak_memory_bytes_per_gpu <= _peak(LLAMA_8B, job, data, MemoryPlan(m, k, 0, p, False))
               for m, k, p in [(1, 32, "bf16-sr-8bit"), (1, 0, "bf16-sr-8bit"), (8, 32, "bf16-sr")])  # fmt: skip
    changes = {alternative.change: alternative for alternative in planned.alternatives}
    assert set(changes) == {"n_gpus 2 and distributed fsdp", "LoRA (r=16)", "max_seq_length 1024"}
    for alternative in planned.alternatives:
        hyperparameters = {**job.hyperparameters.model_dump(), **alternative.hyperparameters}
        changed = JobSpec(hyperparameters=JobHyperparameters(**hyperparameters))
        shorter = dataclasses.replace(data, padded_length=min(8192, changed.hyperparameters.max_seq_length))
        again = plan_job(LLAMA_8B, changed, shorter, memory)
        assert again.fits and again.plan == alternative.plan
        assert again.estimate.peak_memory_bytes_per_gpu == alternative.peak_memory_bytes_per_gpu <= memory
    fsdp = changes["n_gpus 2 and distributed fsdp"].plan
    # The 8-bit state runs under FSDP: its smaller shards leave room to recompute fewer layers (19 of 32 against
    # bf16-sr's 30 at the same micro-batch), which the time model ranks faster.
    assert fsdp.precision == "bf16-sr-8bit"
    same_gpus = {
        **job.hyperparameters.model_dump(),
        **changes["n_gpus 2 and distributed fsdp"].hyperparameters,
    }
    bf16_sr = JobSpec(hyperparameters=JobHyperparameters(**{**same_gpus, "precision": "bf16-sr"}))
    assert plan_job(LLAMA_8B, bf16_sr, data, memory).plan.recompute_layers > fsdp.recompute_layers
    message = planned.refusal()
    assert "even with its smallest plan" in message and "more than the 40.0 GiB" in message
    assert (
        "n_gpus 2 and distributed fsdp (micro-batch 1, precision bf16-sr" in message
        and "GiB per GPU" in message
    )
    # Nothing helps a 16 GiB GPU but many GPUs.
    tight = plan_job(
        LLAMA_8B, _job(max_seq_length=2048, optimizer_state_on_host=False), _data(2048), 16 * GIB
    )
    # The fewest GPUs that fit: 4, with the 8-bit state sharded (bf16-sr's 4-byte state needs 8).
    assert [(a.change, a.plan.precision) for a in tight.alternatives] == [
        ("n_gpus 4 and distributed fsdp", "bf16-sr-8bit")
    ]
    assert not plan_job(LLAMA_8B, _job(optimizer_state_on_host=False), _data(), 4 * GIB).alternatives


def test_the_checkpoints_must_fit_the_disk():
    job = _job()
    plan = MemoryPlan(1, 0, 0, "bf16-sr", False)
    size = checkpoint_bytes(LLAMA_8B, job, "bf16-sr")
    assert 47e9 < size < 49e9  # 8.03e9 parameters: bf16 weights and two bf16 AdamW moments
    disk = checkpoint_disk(LLAMA_8B, job, plan, keep_last_checkpoints=2, free_bytes=100 * 10**9)
    assert (disk.checkpoints_on_disk, disk.needed_bytes) == (3, 3 * size)  # the kept two and the next
    assert disk.fits is False
    message = disk.refusal()
    assert f"{3 * size / 1e9:.1f} GB" in message and "3 checkpoints" in message and "100.0 GB free" in message
    # The 8-bit state shrinks the training state: 3 checkpoints of about 32 GB fit 100 GB.
    eight_bit = checkpoint_disk(
        LLAMA_8B, job, dataclasses.replace(plan, precision="bf16-sr-8bit"), 2, 100 * 10**9
    )
    assert eight_bit.fits and eight_bit.refusal() is None and eight_bit.checkpoint_bytes < 0.7 * size
    # A resumed run's checkpoints are on the disk already; an unknown free space refuses nothing.
    assert checkpoint_disk(LLAMA_8B, job, plan, 2, 100 * 10**9, checkpoints_present=2).fits
    assert checkpoint_disk(LLAMA_8B, job, plan, 2, None).refusal() is None


def test_a_run_that_saves_nothing_before_its_end_needs_the_disk_of_its_final_checkpoint():
    """With no checkpoint by steps, minutes, epochs (of several) or early stopping, only the final one is written:
    an 8B job with the 8-bit state (32 GB a checkpoint) fits 52 GB free, which 3 checkpoints do not."""
    job, eight_bit = _job(n_epochs=1), MemoryPlan(1, 0, 0, "bf16-sr-8bit", False)
    size = checkpoint_bytes(LLAMA_8B, job, "bf16-sr-8bit")
    assert not saves_before_the_end(job, None, True, None)  # one epoch: its checkpoint is the final one
    final_only = checkpoint_disk(LLAMA_8B, job, eight_bit, 2, 52 * 10**9, periodic=False)
    assert (final_only.checkpoints_on_disk, final_only.needed_bytes, final_only.fits) == (1, size, True)
    assert checkpoint_disk(LLAMA_8B, job, eight_bit, 2, 52 * 10**9).fits is False  # the kept two and the next
    # A paused run's checkpoint stays until the final one is whole: one more checkpoint, never none.
    resumed = checkpoint_disk(LLAMA_8B, job, eight_bit, 2, 52 * 10**9, checkpoints_present=1, periodic=False)
    assert (resumed.checkpoints_on_disk, resumed.needed_bytes) == (2, size)
    assert (
        "its final checkpoint of"
        in checkpoint_disk(LLAMA_8B, job, eight_bit, 2, 10**9, periodic=False).refusal()
    )
    # Each schedule that saves before the end counts.
    assert saves_before_the_end(job, 100, False, None) and saves_before_the_end(job, None, False, 30.0)
    assert saves_before_the_end(_job(n_epochs=3), None, True, None)
    assert not saves_before_the_end(_job(n_epochs=3), None, False, None)
    assert saves_before_the_end(_job(n_epochs=1, early_stopping={"patience": 2}), None, False, None)


def test_a_pinned_precision_is_offered_its_smaller_optimizer_state_and_keeps_it_under_fsdp():
    """An 8B fp8 job at 8 x 8192 on a 64 GiB GPU: fp8's bf16 AdamW state leaves no plan that fits, fp8-8bit's
    8-bit state does, and the refusal names it (not bf16-sr-8bit, which would drop the float8 matmuls). A
    pinned fp8-8bit job's FSDP alternative keeps fp8-8bit (its 8-bit optimizer runs under FSDP), not "auto"."""
    job, data, memory = _job(precision="fp8", optimizer_state_on_host=False), _data(), 64 * GIB
    planned = plan_job(LLAMA_8B, job, data, memory)
    assert planned.fits is False
    changes = {alternative.change: alternative for alternative in planned.alternatives}
    assert changes["precision fp8-8bit"].plan.precision == "fp8-8bit"
    assert changes["precision fp8-8bit"].peak_memory_bytes_per_gpu <= memory
    assert plan_job(LLAMA_8B, _job(precision="fp8-8bit"), data, memory).fits

    pinned = plan_job(LLAMA_8B, _job(precision="fp8-8bit", optimizer_state_on_host=False), data, 40 * GIB)
    fsdp = next(a for a in pinned.alternatives if a.change.startswith("n_gpus"))
    # Its 8-bit optimizer runs under FSDP, so the alternative keeps the pinned precision as it is.
    assert "precision" not in fsdp.hyperparameters and fsdp.plan.precision == "fp8-8bit"
    # "auto" plans over the state's precision itself: no precision alternative.
    on_gpu = _job(optimizer_state_on_host=False)
    assert not any(
        a.change.startswith("precision") for a in plan_job(LLAMA_8B, on_gpu, data, 40 * GIB).alternatives
    )


def test_a_state_too_large_for_the_gpu_goes_to_host_memory():
    """An 8B full fine-tune on a 24 GiB GPU: the bf16 weights (15 GiB) leave no room for even the 8-bit state
    (15 GiB), so the plan keeps the state in host memory, with the GPU holding one parameter's state, and pays its
    two crossings of the host link a step. Where the state fits the GPU, the plan keeps it there."""
    job, data = _job(batch_size=1, max_seq_length=2048), _data(2048)
    planned = plan_job(LLAMA_8B, job, data, 24 * GIB)
    assert planned.fits and planned.plan.optimizer_state_on_host
    assert planned.estimate.peak_memory_bytes_per_gpu <= 24 * GIB * PLANNABLE_FRACTION
    state = planned.estimate.host_optimizer_state_bytes
    precision = planned.plan.precision
    per_parameter = {"bf16-sr": 4, "bf16-sr-8bit": 2 * (1 + 4 / 256)}[precision]
    assert state == int(LLAMA_8B.parameter_count() * per_parameter)
    # The GPU holds the largest tensor's state (the embedding table's), not all of it.
    on_gpu = dataclasses.replace(planned.plan, optimizer_state_on_host=False)
    assert _peak(LLAMA_8B, job, data, on_gpu) - planned.estimate.peak_memory_bytes_per_gpu == pytest.approx(
        state - LLAMA_8B.vocab_size * LLAMA_8B.hidden_size * per_parameter, rel=1e-6
    )
    # Its cost in the time model: the state in and out over the host link.
    link = TIME_COSTS.host_link_bytes_per_s
    slower = step_time_s(LLAMA_8B, job, data, planned.plan) - step_time_s(LLAMA_8B, job, data, on_gpu)
    assert slower == pytest.approx(2 * state / link, rel=1e-6)
    # Pinned to the GPU it fits nowhere; a pin on the host is kept even where the GPU has room.
    assert plan_job(LLAMA_8B, _job(batch_size=1, max_seq_length=2048, optimizer_state_on_host=False), data,
                    24 * GIB).fits is False  # fmt: skip
    roomy = plan_job(LLAMA_8B, job, data, 80 * GIB)
    assert roomy.fits and not roomy.plan.optimizer_state_on_host
    pinned = plan_job(LLAMA_8B, _job(batch_size=1, max_seq_length=2048, optimizer_state_on_host=True), data,
                      80 * GIB)  # fmt: skip
    assert pinned.plan.optimizer_state_on_host and "optimizer state in host memory" in pinned.plan.describe()
    # An optimizer that cannot stage its state is refused the pin, naming the field.
    request = HyperparametersRequest(precision="bf16-mixed", optimizer_state_on_host=True)
    with pytest.raises(SpecError, match="cannot keep its state in host memory") as refused:
        JobSpec.from_request(None, request, example_count=8, base_learning_rate=1e-4)
    assert refused.value.field == "hyperparameters.optimizer_state_on_host"


@pytest.mark.parametrize("n_gpus", [2, 4, 8])
def test_the_8bit_modes_are_planned_under_fsdp_with_their_state_sharded(n_gpus):
    """Under FSDP "auto" considers the 8-bit optimizer's modes (each rank quantizes its own shard), and a
    rank's optimizer state is the whole state divided by the world size: the 8-bit modes' per-rank saving over
    bf16-sr (2.03 bytes of state per parameter against 4) is the one-GPU saving divided by n_gpus."""
    fsdp = {
        "distributed": "fsdp",
        "n_gpus": n_gpus,
        "batch_size": 8 * n_gpus,
        "optimizer_state_on_host": False,
    }
    precisions = _choices(LLAMA_8B, _job(**fsdp), on_gpu=True, memory_known=True)[0]
    assert "bf16-sr-8bit" in precisions
    assert precisions == _choices(LLAMA_8B, _job(), on_gpu=True, memory_known=True)[0]  # FSDP leaves none out

    def weights_grads_optimizer(precision: str, **hyperparameters) -> int:
        job = _job(precision=precision, **hyperparameters)
        plan = MemoryPlan(1, LLAMA_8B.num_layers, 0, precision, False, False)
        return estimate_job(LLAMA_8B, job, _data(), plan=plan).memory_breakdown["weights_grads_optimizer"]

    one = {"optimizer_state_on_host": False}
    saving_on_one = weights_grads_optimizer("bf16-sr", **one) - weights_grads_optimizer("bf16-sr-8bit", **one)
    saving = weights_grads_optimizer("bf16-sr", **fsdp) - weights_grads_optimizer("bf16-sr-8bit", **fsdp)
    # (4 - 2.03125) bytes per parameter over the 8B shape's parameters, on one GPU and on each of n_gpus.
    assert saving_on_one == int(LLAMA_8B.parameter_count() * (4 - (2 + 2 * 4 / 256)))
    assert abs(saving - saving_on_one / n_gpus) <= 1  # each estimate rounds its division down
