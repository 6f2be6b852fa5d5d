"""The mechanisms a memory plan chooses among, on this CPU: the optimizer step inside the backward, and which
decoder layers recompute or offload their activations (offload itself needs a GPU: tests/models/ on the GPU).
Exact resume of the step inside the backward is in test_train_resume.py."""

from __future__ import annotations

import pytest
import torch

from fusetune.demo import assets
from fusetune.kernels import FusedAdamW, gradient_clipping_scale
from fusetune.worker.train import optimizer_in_backward
from fusetune.worker.train.activations import decoder_layers, plan_layout
from fusetune.worker.train.optimizer_in_backward import OptimizerInBackward
from fusetune.worker.train.outcome import TrainingFailure
from fusetune.worker.train.trainer import Trainer
from tests.worker.test_train_trainer import ONE_CPU_RANK, RecordingReporter, make_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    return assets.write_demo_dataset(tmp_path_factory.mktemp("data") / "train.jsonl", n_examples=24, seed=3)


def _trained(model_dir, train_file, out, **plan):
    reporter = RecordingReporter()
    config = make_config(
        model_dir, train_file, out, precision="bf16-sr", micro_batch_size=8, max_steps=3, **plan
    )
    trainer = Trainer(config, ONE_CPU_RANK, reporter)
    trainer.train()
    return trainer, reporter


def test_without_clipping_the_step_inside_the_backward_trains_the_same_weights(
    model_dir, train_file, tmp_path, bf16_sr_on_cpu
):
    """With nothing to clip, updating each parameter as its gradient completes is the same update as one step
    after the backward, bit for bit, and the reported norms are the same; no gradient is left afterwards."""
    after, after_reporter = _trained(model_dir, train_file, tmp_path / "after", max_grad_norm=None)
    inside, inside_reporter = _trained(
        model_dir, train_file, tmp_path / "inside", max_grad_norm=None, optimizer_in_backward=True
    )
    assert inside.in_backward is not None and after.in_backward is None
    for a, b in zip(after.model.parameters(), inside.model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert b.grad is None
    losses = [[v["train_loss"] for _, v in r.metrics] for r in (inside_reporter, after_reporter)]
    assert losses[0] == losses[1]
    # torch's norm of bf16 gradients comes back in bf16 (8 significant bits); the hooks sum squares in fp32.
    torch.testing.assert_close(
        [v["grad_norm"] for _, v in inside_reporter.metrics],
        [v["grad_norm"] for _, v in after_reporter.metrics],
        rtol=2**-7,
        atol=0,
    )


def _grads(model, inputs):
    model.zero_grad(set_to_none=True)
    model(inputs).square().mean().backward()


def test_each_step_is_clipped_by_the_previous_steps_norm(device):
    """Step 1 unclipped; step t clipped by min(1, max_norm / norm_{t-1}): the same as FusedAdamW stepped after the
    backward with that factor. Clipping by the current norm instead would give other weights at step 2."""
    torch.manual_seed(0)
    inputs = [torch.randn(4, 6, device=device) for _ in range(3)]
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    reference = reference.bfloat16().to(device)
    model = (
        torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        .bfloat16()
        .to(device)
    )
    model.load_state_dict(reference.state_dict())
    max_norm = 1e-3  # far below the gradients' norms: every step after the first is clipped
    expected = FusedAdamW(reference.parameters(), lr=1e-2, seed=1)
    previous = float("nan")
    for batch in inputs:
        _grads(reference, batch.bfloat16())
        # In fp32, as the hooks sum it (torch's norm of bf16 gradients is a bf16 number).
        norm = torch.stack(
            [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in reference.parameters()]
        )
        norm = torch.linalg.vector_norm(norm)
        factor = (
            torch.tensor(1.0, device=device)
            if previous != previous
            else gradient_clipping_scale(torch.tensor(previous, device=device), max_norm)
        )
        expected.step(grad_scale=factor)
        previous = float(norm)

    inside = OptimizerInBackward(
        FusedAdamW(model.parameters(), lr=1e-2, seed=1), list(model.parameters()), max_norm
    )
    carried = float("nan")
    norms = []
    for batch in inputs:
        loss = model(batch.bfloat16()).square().mean()
        inside.start(loss, carried)
        loss.backward()
        carried = float(inside.finish())
        norms.append(carried)
    assert norms[-1] == pytest.approx(previous, rel=1e-6)
    # The two norms are summed in different orders (a last-bit difference in the factor may move a stochastic
    # rounding by one bf16 step); clipping by the current norm instead moves weights by about the learning rate.
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2**-9)


def test_a_non_finite_loss_changes_no_weight(device):
    model = torch.nn.Linear(4, 2).bfloat16().to(device)
    before = [p.detach().clone() for p in model.parameters()]
    inside = OptimizerInBackward(
        FusedAdamW(model.parameters(), lr=1.0, seed=0), list(model.parameters()), 1.0
    )
    loss = model(torch.randn(3, 4, device=device).bfloat16()).sum() * float("inf")
    inside.start(loss, float("nan"))
    loss.backward()
    assert not torch.isfinite(inside.finish())
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("optimizer", "world_size", "accumulation", "names"),
    [
        ("adamw-stochastic-rounding", 2, 1, "single process"),
        ("adamw-stochastic-rounding", 1, 4, "one micro-batch per step"),
        ("adamw", 1, 1, "clipping factor"),
    ],
)
def test_where_the_step_inside_the_backward_cannot_run_says_why(optimizer, world_size, accumulation, names):
    assert names in optimizer_in_backward.refusal(optimizer, world_size, accumulation)
    assert optimizer_in_backward.refusal("adamw-8bit", 1, 1) is None


def test_a_trainer_refuses_the_step_inside_the_backward_with_accumulation(
    model_dir, train_file, tmp_path, bf16_sr_on_cpu
):
    config = make_config(
        model_dir, train_file, tmp_path, precision="bf16-sr", micro_batch_size=2, optimizer_in_backward=True
    )
    with pytest.raises(TrainingFailure, match="one micro-batch per step"):
        Trainer(config, ONE_CPU_RANK, RecordingReporter())


def test_the_cheapest_layers_recompute_and_the_first_offload():
    # Sliding-window layers first, the last among equals; offloaded layers are never also recomputed.
    types = ["sliding_attention", "full_attention"] * 3
    layout = plan_layout(6, recompute_layers=3, offload_layers=2, layer_types=types)
    assert layout.offloaded == (0, 1)
    assert layout.recomputed == (2, 4, 5)
    assert plan_layout(4, 4, 0).recomputed == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="more than the model's 4 decoder layers"):
        plan_layout(4, 3, 2)


def test_recomputed_layers_train_as_the_whole_model_does(model_dir, train_file, tmp_path):
    """Recomputing some layers changes where activations come from, not the result: the same losses and weights
    as keeping every activation (fp32 on CPU is deterministic)."""
    runs = []
    for name, plan in (("kept", {}), ("some", {"recompute_layers": 1})):
        reporter = RecordingReporter()
        trainer = Trainer(
            make_config(model_dir, train_file, tmp_path / name, max_steps=2, **plan), ONE_CPU_RANK, reporter
        )
        trainer.train()
        runs.append((trainer, reporter))
    (kept, kept_reporter), (some, some_reporter) = runs
    flags = [layer.gradient_checkpointing for layer in decoder_layers(some.model)]
    assert sum(flags) == 1 and flags[-1], flags
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(kept.model))
    torch.testing.assert_close(
        [v["train_loss"] for _, v in some_reporter.metrics],
        [v["train_loss"] for _, v in kept_reporter.metrics],
    )
    for a, b in zip(kept.model.parameters(), some.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_offload_needs_a_gpu(model_dir, train_file, tmp_path):
    with pytest.raises(TrainingFailure, match="offload_layers needs a GPU"):
        Trainer(
            make_config(model_dir, train_file, tmp_path, offload_layers=1), ONE_CPU_RANK, RecordingReporter()
        )


@pytest.mark.gpu
def test_offloaded_and_recomputed_layers_train_as_kept_ones_on_the_gpu(
    model_dir, train_file, tmp_path, monkeypatch
):
    """Offload copies saved tensors to pinned host memory and back on a side stream: a tensor read before its
    copy back lands, or a stale one, would change the gradients. Losses and weights must follow the run that
    keeps everything, within what the GPU's reduction order moves in fp32."""
    from fusetune.worker.train import activations

    monkeypatch.setattr(activations, "MIN_OFFLOAD_BYTES", 0)  # the tiny model's tensors are all small
    device = torch.device("cuda", 0)
    dist = type(ONE_CPU_RANK)(rank=0, local_rank=0, world_size=1, device=device)
    runs = []
    for name, plan in (("kept", {}), ("offloaded", {"offload_layers": 1, "recompute_layers": 1})):
        reporter = RecordingReporter()
        config = make_config(model_dir, train_file, tmp_path / name, precision="fp32", max_steps=3, **plan)
        trainer = Trainer(config, dist, reporter)
        trainer.train()
        runs.append((trainer, reporter))
    (kept, kept_reporter), (offloaded, offloaded_reporter) = runs
    assert offloaded.activation_layout.offloaded == (0,) and offloaded.activation_layout.recomputed == (1,)
    assert offloaded.activation_offload._saved[0], "nothing was offloaded"
    torch.testing.assert_close(
        [v["train_loss"] for _, v in offloaded_reporter.metrics],
        [v["train_loss"] for _, v in kept_reporter.metrics],
        rtol=1e-5,
        atol=0,
    )
    for a, b in zip(kept.model.parameters(), offloaded.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_the_optimizer_state_in_host_memory_trains_as_on_the_gpu(model_dir, train_file, tmp_path):
    """The trainer with `optimizer_state_on_host`: the same losses and weights bit for bit as with the state on
    the GPU (the same launches on the same values), the state's tensors in pinned host memory, and on the GPU only
    the buffers one parameter's state is staged in."""
    device = torch.device("cuda", 0)
    dist = type(ONE_CPU_RANK)(rank=0, local_rank=0, world_size=1, device=device)
    runs = []
    for name, on_host in (("gpu", False), ("host", True)):
        reporter = RecordingReporter()
        config = make_config(
            model_dir, train_file, tmp_path / name, precision="bf16-sr-8bit", max_steps=3,
            optimizer_state_on_host=on_host, optimizer_in_backward=False, recompute_layers=0, offload_layers=0,
        )  # fmt: skip
        trainer = Trainer(config, dist, reporter)
        trainer.train()
        runs.append((trainer, reporter))
    (on_gpu, gpu_reporter), (on_host, host_reporter) = runs
    losses = [[v["train_loss"] for _, v in reporter.metrics] for reporter in (gpu_reporter, host_reporter)]
    assert losses[0] == losses[1]
    for a, b in zip(on_gpu.model.parameters(), on_host.model.parameters(), strict=True):
        assert torch.equal(a, b)
    states = [state for state in on_host.optimizer.state.values() if state]
    assert states and all(
        tensor.device.type == "cpu" and tensor.is_pinned()
        for state in states
        for name, tensor in state.items()
        if name != "step"
    )
    largest = max(p.numel() for p in on_host.model.parameters())
    assert on_host.optimizer.host_state.device_bytes() < 2.1 * largest  # codes and scales of one parameter
