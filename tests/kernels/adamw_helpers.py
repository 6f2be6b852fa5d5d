"""What the tests of FusedAdamW (test_adamw.py) and FusedAdamW8bit (test_adamw8bit.py) share: their inputs
(fixed random parameters and gradients), the step loops of an optimizer and of its reference, the exact
comparison of weights and state, the hyperparameters and the tolerances against torch.optim.AdamW (the update is
the same in both), and the checks both optimizers must pass the same way (a zero learning rate, a non-finite
norm, a resumed state dict, refused arguments, the real-size comparison on a GPU), and the one-code-step bound of
FusedAdamW8bit's moments (its tests and their torchrun ranks). Each test file keeps its shapes and what is its
kernel's alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

# Seeds of the inputs: the parameters from one, the gradients of step i (from 0) from GRADIENT_SEED + i.
PARAMETER_SEED = 1
GRADIENT_SEED = 100

# (atol, rtol) of the optimizers' parameters against torch.optim.AdamW run on an fp32 copy, per parameter dtype;
# FusedAdamW8bit's update is FusedAdamW's, so one table serves both.
# float32: the same update with the bias correction of the second moment multiplied by its inverse instead of
#   divided, a few fp32 roundings apart (parameters near 1, updates near lr).
# bfloat16: the stochastically rounded weight is one of the two bf16 neighbours of the fp32 result, at most one
#   bf16 ulp (2^-7 relative) away; round to nearest would allow half of that, so the bound is the ulp itself.
TOLERANCES = {
    torch.float32: (1e-7, 2e-6),
    torch.bfloat16: (0.0, 2.0**-7),
}
HYPERPARAMETERS = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 3


def assert_within_one_code_step(stored, exact, scales, mantissa_bits, block_size=256) -> None:
    """Each stored 8-bit moment is within one code step of the exact one: 2^-mantissa_bits of the exact value's
    magnitude, or of 2^-14 of its block's scale (the subnormal codes' step) if that is larger. `scales`: one
    per block of `block_size` consecutive elements of the flattened tensors."""
    block_scale = scales.repeat_interleave(block_size)[: exact.numel()].view(exact.shape)
    step = torch.maximum(exact.abs(), block_scale * 2.0**-14) * 2.0**-mantissa_bits
    error = (stored - exact).abs()
    assert torch.all(error <= step * (1 + 2.0**-12)), (
        f"largest error / code step {(error / step).max().item()}"
    )


def random_tensors(shapes, dtype, device, seed, scale=1.0) -> list[torch.Tensor]:
    """N(0, scale^2) tensors of `shapes`, drawn in fp32 on the CPU from `seed`, then cast and moved."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * scale).to(dtype).to(device) for shape in shapes]


def step_on(params, optimizer, grads, grad_scale=None) -> None:
    """One step of `optimizer` with `grads` (each cast to its parameter's dtype) as the gradients."""
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.to(param.dtype)
    optimizer.step(grad_scale=grad_scale)


def run_optimizer(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    shapes,
    param_dtypes,
    device,
    *,
    steps: int,
    grad_scale: torch.Tensor | None = None,
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Params and optimizer after `steps` steps on the fixed random inputs (parameters drawn in fp32, then each
    cast to its dtype of `param_dtypes`)."""
    start = random_tensors(shapes, torch.float32, device, seed=PARAMETER_SEED)
    params = [torch.nn.Parameter(p.to(dtype)) for p, dtype in zip(start, param_dtypes, strict=True)]
    optimizer = make_optimizer(params)
    for step in range(steps):
        grads = random_tensors(shapes, torch.float32, device, seed=GRADIENT_SEED + step)
        step_on(params, optimizer, grads, grad_scale)
    return params, optimizer


def run_reference(
    make_state: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    reference_step: Callable[
        [list[torch.Tensor], list[torch.Tensor], list[dict[str, torch.Tensor]], int], None
    ],
    shapes,
    param_dtypes,
    device,
    *,
    steps: int,
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Parameters and states after `steps` calls of `reference_step(params, grads, states, step)` (step from
    1) on the inputs of `run_optimizer`, each state made by `make_state(param)` first."""
    start = random_tensors(shapes, torch.float32, device, seed=PARAMETER_SEED)
    params = [p.to(dtype) for p, dtype in zip(start, param_dtypes, strict=True)]
    states = [make_state(p) for p in params]
    for step in range(steps):
        grads = random_tensors(shapes, torch.float32, device, seed=GRADIENT_SEED + step)
        reference_step(params, [g.to(p.dtype) for p, g in zip(params, grads, strict=True)], states, step + 1)
    return params, states


def assert_same_weights_and_state(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    ref_params: Sequence[torch.Tensor],
    ref_states: Sequence[dict[str, torch.Tensor]],
) -> None:
    """Bit for bit: each parameter is its reference, and each tensor of `ref_states` the optimizer's of that
    name (kernel and reference perform the same IEEE fp32 operations and draw the same random bits)."""
    for param, ref_param, ref_state in zip(params, ref_params, ref_states, strict=True):
        torch.testing.assert_close(param.detach(), ref_param, atol=0.0, rtol=0.0)
        for name, value in ref_state.items():
            torch.testing.assert_close(
                optimizer.state[param][name],
                value,
                atol=0.0,
                rtol=0.0,
                msg=lambda m, name=name: f"{name}: {m}",
            )


def assert_zero_learning_rate_leaves_bf16_weights_unchanged(optimizer_class, shapes, device) -> None:
    """An update of zero rounds to the weight itself (the distributed checkpoint helpers step with lr 0 to
    create the state)."""
    start = random_tensors(shapes, torch.bfloat16, device, seed=PARAMETER_SEED)
    params = [torch.nn.Parameter(p.clone()) for p in start]
    optimizer = optimizer_class(params, lr=0.0, weight_decay=0.1)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    for param, before in zip(params, start, strict=True):
        torch.testing.assert_close(param.detach(), before, atol=0.0, rtol=0.0)


def assert_a_non_finite_norm_changes_nothing(params, optimizer, device) -> None:
    """The trainer's guard against a non-finite gradient, decided on the device: a NaN or infinite norm gives a
    NaN clipping scale, and a step with it writes nothing, on gradients of NaN; a finite scale on the same
    gradients then does write (NaN), the control that the step ran at all."""
    from fusetune.kernels.adamw import gradient_clipping_scale

    before = [p.detach().clone() for p in params]
    state_before = [{k: v.clone() for k, v in optimizer.state[p].items() if k != "step"} for p in params]
    for param in params:
        param.grad = torch.full_like(param, float("nan"))
    for bad_norm in (float("nan"), float("inf")):
        scale = gradient_clipping_scale(torch.tensor(bad_norm, device=device), 1.0)
        assert torch.isnan(scale)
        optimizer.step(grad_scale=scale)
    assert_same_weights_and_state(params, optimizer, before, state_before)
    optimizer.step(grad_scale=gradient_clipping_scale(torch.tensor(1.0, device=device), 1.0))
    assert torch.isnan(params[0]).any()


def resume_on_copies(params, saved, make_optimizer):
    """Copies of `params` and a new optimizer over them (`make_optimizer`) loaded from the state dict `saved`."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make_optimizer(copies)
    resumed.load_state_dict(saved)
    return copies, resumed


def assert_bad_arguments_are_refused_with_the_field(optimizer_class, device) -> None:
    """What both optimizers refuse alike: fp16 parameters and a negative seed when built, a grad_scale of more
    than one element and a tensor learning rate at the step."""
    with pytest.raises(TypeError, match="bfloat16 or float32, got torch.float16"):
        optimizer_class([torch.nn.Parameter(torch.ones(3, dtype=torch.float16))])
    with pytest.raises(ValueError, match="seed"):
        optimizer_class([torch.nn.Parameter(torch.ones(3))], seed=-1)
    param = torch.nn.Parameter(torch.ones(3, device=device))
    param.grad = torch.ones_like(param)
    with pytest.raises(ValueError, match="grad_scale must be one element"):
        optimizer_class([param]).step(grad_scale=torch.ones(2, device=device))
    optimizer = optimizer_class([param], lr=torch.tensor(0.1))
    with pytest.raises(TypeError, match="lr must be a Python float"):
        optimizer.step()


# The GPU comparison at real sizes: a model's weight matrices both ways round, a vector, a ragged matrix, a scalar.
REAL_SHAPES = [(2048, 8192), (8192, 2048), (2048,), (4095, 17), (1,)]
REAL_SIZE_HYPERPARAMETERS = {"lr": 1e-5, "weight_decay": 0.01, "seed": 3}


def assert_matches_reference_exactly_at_real_sizes(
    make_optimizer: Callable[..., torch.optim.Optimizer],
    make_state: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    reference_step: Callable[..., None],
    device,
) -> None:
    """Three steps of `make_optimizer(params, **REAL_SIZE_HYPERPARAMETERS)` on bf16 weights of REAL_SHAPES,
    with a grad_scale of 0.5, bit for bit against `reference_step(params, grads, states, step=..., grad_scale=...,
    **REAL_SIZE_HYPERPARAMETERS)` on states made by `make_state(param)`."""
    params = [
        torch.nn.Parameter(p)
        for p in random_tensors(REAL_SHAPES, torch.bfloat16, device, seed=PARAMETER_SEED, scale=0.02)
    ]
    reference = [p.detach().clone() for p in params]
    states = [make_state(p) for p in reference]
    optimizer = make_optimizer(params, **REAL_SIZE_HYPERPARAMETERS)
    scale = torch.tensor(0.5, device=device)
    for step in range(1, 4):
        grads = random_tensors(REAL_SHAPES, torch.bfloat16, device, seed=GRADIENT_SEED + step, scale=1e-3)
        step_on(params, optimizer, grads, grad_scale=scale)
        reference_step(reference, grads, states, step=step, grad_scale=scale, **REAL_SIZE_HYPERPARAMETERS)
    assert_same_weights_and_state(params, optimizer, reference, states)


@pytest.fixture
def one_process_group():
    """A gloo process group of one rank in this process, with a one-device CPU mesh, for FSDP2 on CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
