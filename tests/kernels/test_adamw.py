"""FusedAdamW's kernel against its bit-exact reference, against torch.optim.AdamW, and its stochastic rounding.

On CPU the real Triton kernel runs under TRITON_INTERPRET=1 (set by tests/conftest.py) with 512-element blocks,
so the 4095-element tensor walks eight blocks with a ragged tail. Kernel and reference perform the same IEEE
fp32 operations and draw the same random bits, so they are compared exactly; the reference itself is compared
with torch.optim.AdamW within TOLERANCES. The quality evidence (fine-tuning a pretrained model) is in
test_adamw_quality.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusetune.kernels import adamw as adamw_module
from fusetune.kernels.adamw import (
    FusedAdamW,
    adamw_state_bytes_per_parameter,
    adamw_step_reference,
    block_maxima_reference,
    gradient_clipping_scale,
    stochastic_rounding_key,
)
from tests.kernels import adamw_helpers
from tests.kernels.adamw_helpers import (
    HYPERPARAMETERS,
    STEPS,
    TOLERANCES,
    assert_a_non_finite_norm_changes_nothing,
    assert_bad_arguments_are_refused_with_the_field,
    assert_same_weights_and_state,
    random_tensors,
    resume_on_copies,
    run_optimizer,
    run_reference,
    step_on,
)
from tests.kernels.mutation import mutated_kernel

# TOLERANCES (against torch.optim.AdamW), HYPERPARAMETERS and STEPS are FusedAdamW8bit's too: adamw_helpers.py.
# exp_avg / exp_avg_sq (fp32) against torch.optim.AdamW's: torch forms exp_avg with lerp and exp_avg_sq with
# addcmul, a few fp32 roundings from the two products and a sum here; where the sum cancels (exp_avg near zero)
# the difference is absolute, about an ulp of the terms (gradients are N(0, 1)).
STATE_TOLERANCE = (1e-7, 1e-6)
SHAPES = [(1,), (5,), (4095,), (33, 17)]


def _run_fused(param_dtypes, device, *, state_dtype=torch.bfloat16, seed=7, grad_scale=None, steps=STEPS):
    """Params and optimizer after `steps` steps of FusedAdamW on fixed random gradients."""
    return run_optimizer(
        lambda params: FusedAdamW(params, **HYPERPARAMETERS, seed=seed, state_dtype=state_dtype),
        SHAPES, param_dtypes, device, steps=steps, grad_scale=grad_scale,
    )  # fmt: skip


def _run_reference(param_dtypes, device, *, state_dtype=torch.bfloat16, seed=7, grad_scale=None, steps=STEPS):
    """Params and {exp_avg, exp_avg_sq} of each after `steps` reference steps on _run_fused's inputs."""

    def zero_state(param):
        dtype = param.dtype if param.dtype == torch.float32 else state_dtype
        return {
            "exp_avg": torch.zeros_like(param, dtype=dtype),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype),
        }

    def reference_step(params, grads, states, step):
        adamw_step_reference(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], step=step,
            **HYPERPARAMETERS, seed=seed, grad_scale=grad_scale,
        )  # fmt: skip

    return run_reference(zero_state, reference_step, SHAPES, param_dtypes, device, steps=steps)


PARAM_DTYPE_SETS = [
    pytest.param([torch.bfloat16] * 4, torch.bfloat16, id="bf16-params-bf16-state"),
    pytest.param([torch.bfloat16] * 4, torch.float32, id="bf16-params-fp32-state"),
    pytest.param([torch.float32] * 4, torch.bfloat16, id="fp32-params"),
    # one group, two launches (bf16 and fp32 tensors); element offsets still count the whole group
    pytest.param([torch.bfloat16, torch.float32, torch.bfloat16, torch.float32], torch.bfloat16, id="mixed"),
]


@pytest.mark.parametrize("grad_scale", [None, 0.37], ids=["no-scale", "grad-scale"])
@pytest.mark.parametrize(("param_dtypes", "state_dtype"), PARAM_DTYPE_SETS)
def test_kernel_matches_reference_exactly(param_dtypes, state_dtype, grad_scale, device):
    scale = None if grad_scale is None else torch.tensor(grad_scale, device=device)
    params, optimizer = _run_fused(param_dtypes, device, state_dtype=state_dtype, grad_scale=scale)
    ref_params, ref_states = _run_reference(param_dtypes, device, state_dtype=state_dtype, grad_scale=scale)
    assert_same_weights_and_state(params, optimizer, ref_params, ref_states)
    for param in params:
        assert optimizer.state[param]["step"].item() == STEPS


def _record_launches(monkeypatch, argument: str) -> list:
    """The value of the AdamW kernel's keyword `argument` at each launch from now on (the launch still runs)."""
    launched = []
    kernel = adamw_module._adamw_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs[argument])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(adamw_module, "_adamw_kernel", Recorder())
    return launched


def test_tensors_off_the_vector_alignment_take_the_masked_path_and_match_the_reference(monkeypatch, device):
    """Whole blocks of tensors that all start at a multiple of 16 bytes go unmasked in 16-byte vectors; one
    tensor that does not (a view one element into its buffer) sends the launch down the masked path, whose
    loads need no alignment. Both give the reference's bits."""
    launched = _record_launches(monkeypatch, "ALIGNED")
    for offset in (0, 1):
        buffers = random_tensors([(offset + 4095,), (offset + 1536,)], torch.bfloat16, device, seed=1)
        params = [torch.nn.Parameter(buffer[offset:]) for buffer in buffers]
        reference = [p.detach().clone() for p in params]
        exp_avgs = [torch.zeros_like(p) for p in reference]
        exp_avg_sqs = [torch.zeros_like(p) for p in reference]
        optimizer = FusedAdamW(params, **HYPERPARAMETERS, seed=5)
        grads = random_tensors([(4095,), (1536,)], torch.bfloat16, device, seed=2)
        step_on(params, optimizer, grads)
        adamw_step_reference(reference, grads, exp_avgs, exp_avg_sqs, step=1, **HYPERPARAMETERS, seed=5)
        for param, ref, exp_avg in zip(params, reference, exp_avgs, strict=True):
            torch.testing.assert_close(param.detach(), ref, atol=0.0, rtol=0.0)
            torch.testing.assert_close(optimizer.state[param]["exp_avg"], exp_avg, atol=0.0, rtol=0.0)
    assert launched == [True, False]


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_follows_torch_adamw(param_dtype, device):
    """The update itself (not only the kernel's agreement with the reference) is AdamW's: against
    torch.optim.AdamW on fp32 copies, one step at a time from the same fp32 values."""
    start = random_tensors(SHAPES, torch.float32, device, seed=1)
    torch_params = [torch.nn.Parameter(p.to(param_dtype).float()) for p in start]
    torch_optimizer = torch.optim.AdamW(torch_params, **HYPERPARAMETERS)
    params = [p.detach().to(param_dtype) for p in start]
    exp_avgs = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    exp_avg_sqs = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    atol, rtol = TOLERANCES[param_dtype]
    for step in range(1, STEPS + 1):
        grads = random_tensors(SHAPES, torch.float32, device, seed=100 + step)
        for torch_param, param, grad in zip(torch_params, params, grads, strict=True):
            torch_param.data.copy_(param.float())  # both start this step from the stored weights
            torch_param.grad = grad.to(param_dtype).float()
        torch_optimizer.step()
        adamw_step_reference(
            params, [g.to(param_dtype) for g in grads], exp_avgs, exp_avg_sqs, step=step, **HYPERPARAMETERS
        )
        for torch_param, param, exp_avg, exp_avg_sq in zip(
            torch_params, params, exp_avgs, exp_avg_sqs, strict=True
        ):
            torch.testing.assert_close(param.float(), torch_param.detach(), atol=atol, rtol=rtol)
            state = torch_optimizer.state[torch_param]
            torch.testing.assert_close(
                exp_avg, state["exp_avg"], atol=STATE_TOLERANCE[0], rtol=STATE_TOLERANCE[1]
            )
            torch.testing.assert_close(
                exp_avg_sq, state["exp_avg_sq"], atol=STATE_TOLERANCE[0], rtol=STATE_TOLERANCE[1]
            )


def test_grad_scale_is_the_same_as_scaled_gradients(device):
    scale = torch.tensor(0.37, device=device)
    params, _ = _run_fused([torch.float32] * 4, device, grad_scale=scale)
    unscaled = [torch.nn.Parameter(p) for p in random_tensors(SHAPES, torch.float32, device, seed=1)]
    optimizer = FusedAdamW(unscaled, **HYPERPARAMETERS, seed=7)
    for step in range(STEPS):
        step_on(
            unscaled,
            optimizer,
            [g * scale for g in random_tensors(SHAPES, torch.float32, device, seed=100 + step)],
        )
    for param, other in zip(params, unscaled, strict=True):
        torch.testing.assert_close(param, other, atol=0.0, rtol=0.0)
    # and a scale that matters: without it the result differs
    plain, _ = _run_fused([torch.float32] * 4, device)
    assert not torch.equal(plain[2], params[2])


@pytest.mark.parametrize("optimizer_class", ["FusedAdamW", "FusedAdamW8bit"])
def test_stepping_parameters_one_at_a_time_gives_the_whole_step(optimizer_class, device):
    """The optimizer step inside the backward updates each parameter alone (`params=`) as its gradient completes,
    in the backward's order; every weight and state must come out as one step of all of them would leave it,
    bit for bit (the random bits of a parameter depend on its offset in the group, not on its companions)."""
    from fusetune.kernels import adamw8bit

    cls = FusedAdamW if optimizer_class == "FusedAdamW" else adamw8bit.FusedAdamW8bit
    start = random_tensors(SHAPES, torch.float32, device, seed=1)
    runs = []
    for one_at_a_time in (False, True):
        params = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in start]
        optimizer = cls(
            [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2, seed=3
        )
        for step in range(2):
            grads = random_tensors(SHAPES, torch.bfloat16, device, seed=100 + step)
            if one_at_a_time:
                for param, grad in reversed(list(zip(params, grads, strict=True))):
                    param.grad = grad
                    optimizer.step(grad_scale=torch.tensor([0.5], device=device), params=[param])
                    param.grad = None
            else:
                step_on(params, optimizer, grads, grad_scale=torch.tensor([0.5], device=device))
        runs.append((params, optimizer))
    (whole, whole_optimizer), (single, single_optimizer) = runs
    for a, b in zip(whole, single, strict=True):
        assert torch.equal(a, b)
        for name, value in whole_optimizer.state[a].items():
            assert torch.equal(value, single_optimizer.state[b][name]), name


def test_gradient_clipping_scale_is_clip_grad_norms_factor():
    grads = [torch.full((3,), 2.0), torch.full((4,), -1.0)]
    total_norm = torch.linalg.vector_norm(torch.cat(grads))
    clipped = [g.clone() for g in grads]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, clipped, strict=True):
        param.grad = grad
    torch.nn.utils.clip_grad_norm_(params, max_norm=1.5)
    scale = gradient_clipping_scale(total_norm, 1.5)
    for param, grad in zip(params, grads, strict=True):
        torch.testing.assert_close(param.grad, grad * scale, atol=0.0, rtol=1e-6)
    assert gradient_clipping_scale(total_norm, 100.0).item() == 1.0


# ----------------------------------------------------------------------------------------------------------
# Stochastic rounding
# ----------------------------------------------------------------------------------------------------------

N_ROUNDED = 4095
ULP_BELOW_ONE = 2.0**-8  # bf16 spacing in [0.5, 1)


def _first_step_from_one(device, lr, state_dtype=torch.bfloat16, seed=0):
    """Weights 1.0 and gradients 1.0: the first Adam step moves each weight by lr (times 1 / (1 + eps)), a
    fraction of a bf16 ulp here, and sets exp_avg = 0.1, exp_avg_sq = 0.001, none of them bf16 numbers."""
    param = torch.nn.Parameter(torch.ones(N_ROUNDED, dtype=torch.bfloat16, device=device))
    optimizer = FusedAdamW([param], lr=lr, weight_decay=0.0, seed=seed, state_dtype=state_dtype)
    param.grad = torch.ones_like(param)
    optimizer.step()
    # the fp32 values that were rounded, from the fp32 path of the same update
    exact = torch.nn.Parameter(torch.ones(N_ROUNDED, dtype=torch.float32, device=device))
    exact_optimizer = FusedAdamW([exact], lr=lr, weight_decay=0.0)
    exact.grad = torch.ones_like(exact)
    exact_optimizer.step()
    return param, optimizer.state[param], exact, exact_optimizer.state[exact]


def _assert_unbiased(rounded: torch.Tensor, exact: torch.Tensor) -> None:
    """The mean of the rounded values is the mean of the fp32 values within 5 standard deviations of a mean of
    Bernoulli draws (at most half the bf16 spacing each)."""
    toward_zero, away = _bf16_neighbours(exact)
    sigma = (away - toward_zero).abs().max().double() * 0.5 / rounded.numel() ** 0.5
    error = (rounded.double().mean() - exact.double().mean()).abs()
    assert error <= 5 * sigma, (
        f"mean {rounded.double().mean().item()!r} vs exact {exact.double().mean().item()!r}"
    )


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.85])
def test_stochastic_rounding_is_unbiased(fraction, device):
    param, state, exact, exact_state = _first_step_from_one(device, lr=fraction * ULP_BELOW_ONE)
    # the update is below the ulp, so round to nearest would keep 1.0 (fraction < 0.5) or drop it to 1 - ulp
    assert set(param.detach().float().unique().tolist()) == {1.0, 1.0 - ULP_BELOW_ONE}
    _assert_unbiased(param.detach(), exact.detach())
    _assert_unbiased(state["exp_avg"], exact_state["exp_avg"])
    _assert_unbiased(state["exp_avg_sq"], exact_state["exp_avg_sq"])


def _bf16_neighbours(exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just toward zero and just away from zero of each fp32 value (equal when exact)."""
    bits = exact.view(torch.int32)
    toward_zero = bits & ~0xFFFF
    away = torch.where(bits == toward_zero, toward_zero, toward_zero + 0x10000)
    return toward_zero.view(torch.float32), away.view(torch.float32)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_each_rounded_value_is_one_of_its_two_bf16_neighbours(state_dtype, device):
    params, optimizer = _run_fused([torch.bfloat16] * 4, device, state_dtype=state_dtype, steps=1)
    # the fp32 results of the same update: the reference on fp32 copies of the same bf16 inputs
    start = [p.to(torch.bfloat16).float() for p in random_tensors(SHAPES, torch.float32, device, seed=1)]
    grads = [g.to(torch.bfloat16).float() for g in random_tensors(SHAPES, torch.float32, device, seed=100)]
    exp_avgs = [torch.zeros_like(p) for p in start]
    exp_avg_sqs = [torch.zeros_like(p) for p in start]
    adamw_step_reference(start, grads, exp_avgs, exp_avg_sqs, step=1, **HYPERPARAMETERS)
    for param, exact, exact_m, exact_v in zip(params, start, exp_avgs, exp_avg_sqs, strict=True):
        state = optimizer.state[param]
        for rounded, value in [
            (param.detach(), exact),
            (state["exp_avg"], exact_m),
            (state["exp_avg_sq"], exact_v),
        ]:
            if rounded.dtype == torch.float32:
                torch.testing.assert_close(rounded, value, atol=0.0, rtol=0.0)
                continue
            toward_zero, away = _bf16_neighbours(value)
            rounded = rounded.float()
            assert torch.all((rounded == toward_zero) | (rounded == away)), "a value left its bf16 neighbours"
    # and both neighbours occur, on the 4095 weights
    toward_zero, away = _bf16_neighbours(start[2])
    weights = params[2].detach().float()
    assert (weights == toward_zero).any() and ((weights == away) & (away != toward_zero)).any()


def test_same_seed_same_bits_other_seed_or_step_other_bits(device):
    first, _ = _run_fused([torch.bfloat16] * 4, device, seed=11, steps=1)
    again, _ = _run_fused([torch.bfloat16] * 4, device, seed=11, steps=1)
    other, _ = _run_fused([torch.bfloat16] * 4, device, seed=12, steps=1)
    torch.testing.assert_close(first[2], again[2], atol=0.0, rtol=0.0)
    changed = (first[2] != other[2]).float().mean().item()
    assert 0.05 < changed < 0.95, changed  # some, not all, of the weights round the other way
    keys = {stochastic_rounding_key(seed, step) for seed in (0, 1, 2**40) for step in (1, 2, 3)}
    assert len(keys) == 9
    index = torch.arange(1 << 16, dtype=torch.int64)
    bits_step1, _ = adamw_module._random_bits_reference(index, stochastic_rounding_key(0, 1))
    bits_step2, _ = adamw_module._random_bits_reference(index, stochastic_rounding_key(0, 2))
    assert (bits_step1 != bits_step2).float().mean() > 0.99
    # the 16 bits used for the weights are close to uniform: each of 16 bins holds 1/16 of 65536 draws
    counts = torch.bincount((bits_step1 & 0xFFFF) >> 12, minlength=16).float()
    assert ((counts - 4096).abs() < 5 * 4096**0.5).all(), counts


def test_zero_learning_rate_leaves_bf16_weights_unchanged(device):
    adamw_helpers.assert_zero_learning_rate_leaves_bf16_weights_unchanged(FusedAdamW, SHAPES, device)


def test_a_non_finite_norm_leaves_weights_and_state_as_they_are(device):
    """The trainer's guard against a non-finite gradient, decided on the device: a NaN or infinite norm gives a
    NaN clipping scale, and the step then writes nothing (a gradient holding NaN included)."""
    params, optimizer = _run_fused([torch.bfloat16] * 4, device, steps=1)
    assert_a_non_finite_norm_changes_nothing(params, optimizer, device)


# ----------------------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_state_dict_round_trip_resumes_exactly(state_dtype, device):
    params, optimizer = _run_fused([torch.bfloat16] * 4, device, state_dtype=state_dtype, steps=2)
    copies, resumed = resume_on_copies(
        params, optimizer.state_dict(),
        lambda copies: FusedAdamW(copies, **HYPERPARAMETERS, seed=7, state_dtype=state_dtype),
    )  # fmt: skip
    for param, copy in zip(params, copies, strict=True):
        assert resumed.state[copy]["step"].item() == 2
        assert resumed.state[copy]["exp_avg"].dtype == state_dtype
        torch.testing.assert_close(
            resumed.state[copy]["exp_avg"], optimizer.state[param]["exp_avg"], atol=0, rtol=0
        )
    grads = random_tensors(SHAPES, torch.float32, device, seed=102)
    step_on(params, optimizer, grads)
    step_on(copies, resumed, grads)
    for param, copy in zip(params, copies, strict=True):
        torch.testing.assert_close(param, copy, atol=0.0, rtol=0.0)


def test_loads_torch_adamw_state(device):
    """A checkpoint of torch.optim.AdamW (fp32 state) resumes in FusedAdamW with the state converted."""
    params = [torch.nn.Parameter(p) for p in random_tensors(SHAPES, torch.bfloat16, device, seed=1)]
    torch_optimizer = torch.optim.AdamW(params, **HYPERPARAMETERS)
    for param in params:
        param.grad = torch.ones_like(param)
    torch_optimizer.step()
    optimizer = FusedAdamW(params, **HYPERPARAMETERS, state_dtype=torch.float32)
    optimizer.load_state_dict(torch_optimizer.state_dict())
    state = optimizer.state[params[0]]
    assert state["step"].item() == 1 and state["exp_avg"].dtype == torch.float32
    optimizer.step()
    assert state["step"].item() == 2


one_process_group = adamw_helpers.one_process_group


def test_fsdp2_parameters_update_their_shards_and_checkpoint_like_adamw(one_process_group, device):
    """FSDP2 (DTensor) parameters: the kernel updates the local shards, the state is DTensors, and the trainer's
    full-state-dict save and load (torch.distributed.checkpoint.state_dict) round-trips it with the step."""
    if device != "cpu":
        pytest.skip(
            "a one-rank gloo group on CPU tensors, which the kernel runs on only under the interpreter"
        )
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    fully_shard(model, mesh=one_process_group)
    optimizer = FusedAdamW(model.parameters(), lr=1e-2, seed=1)
    model(torch.randn(4, 5, dtype=torch.bfloat16)).float().sum().backward()
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    expected = [p.to_local().detach().clone() for p in params]
    grads = [p.grad.to_local().clone() for p in params]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(e) for e in expected], [torch.zeros_like(e) for e in expected]
    optimizer.step()
    adamw_step_reference(expected, grads, exp_avgs, exp_avg_sqs, step=1, lr=1e-2, weight_decay=1e-2, seed=1)
    for param, value, exp_avg in zip(params, expected, exp_avgs, strict=True):
        torch.testing.assert_close(param.to_local(), value, atol=0.0, rtol=0.0)
        assert isinstance(optimizer.state[param]["exp_avg"], DTensor)
        torch.testing.assert_close(optimizer.state[param]["exp_avg"].to_local(), exp_avg, atol=0.0, rtol=0.0)
    optimizer.zero_grad(set_to_none=True)

    full = StateDictOptions(full_state_dict=True)
    saved = get_optimizer_state_dict(model, optimizer, options=full)
    assert {value["step"].item() for value in saved["state"].values()} == {1.0}
    resumed = FusedAdamW(model.parameters(), lr=1e-2, seed=1)
    set_optimizer_state_dict(model, resumed, saved, options=full)
    for param in params:
        assert resumed.state[param]["step"].item() == 1
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                resumed.state[param][name].to_local(),
                optimizer.state[param][name].to_local(),
                atol=0.0,
                rtol=0.0,
            )


def test_state_bytes_per_parameter():
    assert adamw_state_bytes_per_parameter(torch.bfloat16) == 4
    assert adamw_state_bytes_per_parameter(torch.bfloat16, torch.float32) == 8
    assert adamw_state_bytes_per_parameter(torch.float32) == 8
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        adamw_state_bytes_per_parameter(torch.float16)


def test_bad_arguments_are_refused_with_the_field(device):
    assert_bad_arguments_are_refused_with_the_field(FusedAdamW, device)
    with pytest.raises(ValueError, match="state_dtype"):
        FusedAdamW([torch.nn.Parameter(torch.ones(3))], state_dtype=torch.float16)


# ----------------------------------------------------------------------------------------------------------
# Mutation tests: a deliberately broken kernel must fail the tests above
# ----------------------------------------------------------------------------------------------------------


def test_round_to_nearest_mutant_fails_the_unbiasedness_test(tmp_path, monkeypatch, device):
    test_stochastic_rounding_is_unbiased(0.3, device)  # the real kernel passes
    mutant = mutated_kernel(
        adamw_module._adamw_kernel,
        "bits + random16",
        "bits + 0x7FFF + ((bits >> 16) & 1)",
        tmp_path,
        "nearest",
    )
    monkeypatch.setattr(adamw_module, "_adamw_kernel", mutant)
    with pytest.raises(AssertionError):
        test_stochastic_rounding_is_unbiased(0.3, device)
    with pytest.raises(AssertionError):
        test_stochastic_rounding_is_unbiased(0.85, device)


MUTATIONS = [
    pytest.param(("grad = grad * grad_scale", "grad = grad * 1.0"), "grad-scale"),
    pytest.param(("numel = tl.where(grad_scale == grad_scale, numel, 0)", "numel = numel"), "no-skip-guard"),
    pytest.param(("mask = offsets < numel", "mask = offsets < numel - 1"), "off-by-one"),
    pytest.param(("* inv_sqrt_bias_correction2", "* 1.0"), "no-bias-correction"),
    pytest.param(("param * weight_decay_factor", "param"), "no-weight-decay"),
    pytest.param(("first = _mix32_kernel(index.to(tl.uint32) ^ high_key)", "first = high_key"), "one-bits-per-tensor"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "what"), MUTATIONS, ids=[m.values[1] for m in MUTATIONS])
def test_mutated_kernel_fails_the_exact_comparison(edit, what, tmp_path, monkeypatch, device):
    mutant = mutated_kernel(adamw_module._adamw_kernel, *edit, tmp_path, what.replace("-", "_"))
    monkeypatch.setattr(adamw_module, "_adamw_kernel", mutant)
    with pytest.raises(AssertionError):
        if what == "no-skip-guard":
            test_a_non_finite_norm_leaves_weights_and_state_as_they_are(device)
        else:
            test_kernel_matches_reference_exactly([torch.bfloat16] * 4, torch.bfloat16, 0.37, device)


# ----------------------------------------------------------------------------------------------------------
# GPU: real sizes
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_matches_reference_exactly_at_real_sizes(state_dtype, device):
    def zero_state(param):
        return {
            "exp_avg": torch.zeros_like(param, dtype=state_dtype),
            "exp_avg_sq": torch.zeros_like(param, dtype=state_dtype),
        }

    def reference_step(params, grads, states, **arguments):
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        adamw_step_reference(params, grads, exp_avgs, exp_avg_sqs, **arguments)

    adamw_helpers.assert_matches_reference_exactly_at_real_sizes(
        lambda params, **hyperparameters: FusedAdamW(params, **hyperparameters, state_dtype=state_dtype),
        zero_state,
        reference_step,
        device,
    )


# ----------------------------------------------------------------------------------------------------------
# Block maxima (float8's weight scales without a pass over the weights)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("param_dtypes", [[torch.bfloat16] * 4, [torch.float32] * 4], ids=["bf16", "fp32"])
def test_kept_block_maxima_are_those_of_the_stored_parameters(param_dtypes, device):
    """Every step rewrites the kept block maxima from the values it stores, tails and tensors smaller than a
    block included; a step skipped by a NaN scale leaves them, as it leaves the parameters."""
    start = random_tensors(SHAPES, torch.float32, device, seed=1)
    params = [torch.nn.Parameter(p.to(dtype)) for p, dtype in zip(start, param_dtypes, strict=True)]
    optimizer = FusedAdamW(params, **HYPERPARAMETERS, seed=7)
    kept = optimizer.keep_block_maxima(params[1:])
    block = adamw_module.adamw_launch_settings().block_size
    for step in range(STEPS):
        grads = random_tensors(SHAPES, torch.float32, device, seed=100 + step)
        step_on(
            params,
            optimizer,
            grads,
            grad_scale=torch.tensor(float("nan") if step == 1 else 0.5, device=device),
        )
        for param in params[1:]:
            torch.testing.assert_close(kept[param], block_maxima_reference(param, block), atol=0.0, rtol=0.0)
    assert params[0] not in kept
    assert [kept[p].numel() for p in params[1:]] == [math.ceil(p.numel() / block) for p in params[1:]]


def test_only_launches_with_kept_maxima_reduce_their_blocks(monkeypatch, device):
    """A launch none of whose tensors keeps block maxima (a bf16-sr job's) skips the block reduction; one with
    such a tensor among others reduces, and writes the maxima of that tensor alone."""
    launched = _record_launches(monkeypatch, "KEEPS_MAXIMA")
    block = adamw_module.adamw_launch_settings().block_size
    for keep in (False, True):
        params = [
            torch.nn.Parameter(p.to(torch.bfloat16))
            for p in random_tensors(SHAPES, torch.float32, device, seed=1)
        ]
        optimizer = FusedAdamW(params, **HYPERPARAMETERS, seed=3)
        kept = optimizer.keep_block_maxima(params[2:3]) if keep else {}
        step_on(params, optimizer, random_tensors(SHAPES, torch.bfloat16, device, seed=2))
        for param, maxima in kept.items():
            torch.testing.assert_close(maxima, block_maxima_reference(param, block), atol=0.0, rtol=0.0)
    assert launched == [False, True]


def test_block_maxima_are_refused_for_parameters_of_another_optimizer(device):
    mine, other = (
        torch.nn.Parameter(torch.ones(3, device=device)),
        torch.nn.Parameter(torch.ones(3, device=device)),
    )
    with pytest.raises(ValueError, match="this optimizer's parameters"):
        FusedAdamW([mine]).keep_block_maxima([other])


def test_a_kernel_that_keeps_no_maxima_fails_the_block_maxima_test(tmp_path, monkeypatch, device):
    mutant = mutated_kernel(
        adamw_module._adamw_kernel,
        "if block_maxima != 0 and start < numel:",
        "if False:",
        tmp_path,
        "no_maxima",
    )
    monkeypatch.setattr(adamw_module, "_adamw_kernel", mutant)
    with pytest.raises(AssertionError):
        test_kept_block_maxima_are_those_of_the_stored_parameters([torch.bfloat16] * 4, device)
