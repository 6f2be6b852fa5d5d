"""FusedAdamW8bit's kernel against its bit-exact reference, the reference against torch.optim.AdamW, its codes,
its stochastic rounding and its state.

On CPU the real Triton kernel runs under TRITON_INTERPRET=1 (set by tests/conftest.py) with 512-element programs
of two 256-element quantization blocks, so the 4095-element tensor walks eight programs and 16 blocks with a
ragged tail. Kernel and reference perform the same IEEE fp32 operations and draw the same random bits, so they
are compared exactly; the reference is compared with torch.optim.AdamW within TOLERANCES. The quality evidence
(fine-tuning a pretrained model) is in test_adamw_quality.py.
"""

from __future__ import annotations

import io

import pytest
import torch

from fusetune.kernels import adamw as adamw_module
from fusetune.kernels import adamw8bit as adamw8bit_module
from fusetune.kernels.adamw import FusedAdamW, adamw_step_reference, stochastic_rounding_key
from fusetune.kernels.adamw8bit import (
    EXP_AVG_MANTISSA_BITS,
    EXP_AVG_SQ_MANTISSA_BITS,
    FusedAdamW8bit,
    adamw8bit_state_bytes_per_parameter,
    adamw8bit_step_reference,
    adamw8bit_zero_state,
    dequantize_moments,
)
from tests.kernels import adamw_helpers
from tests.kernels.adamw_helpers import (
    HYPERPARAMETERS,
    STEPS,
    TOLERANCES,
    assert_a_non_finite_norm_changes_nothing,
    assert_bad_arguments_are_refused_with_the_field,
    assert_same_weights_and_state,
    assert_within_one_code_step,
    random_tensors,
    resume_on_copies,
    run_optimizer,
    run_reference,
    step_on,
)
from tests.kernels.mutation import mutated_function, mutated_kernel

# TOLERANCES: one step of the reference against torch.optim.AdamW run on fp32 copies of the same weights and of
# the same (dequantized) moments, per parameter dtype; the update itself is FusedAdamW's, so the table, the
# HYPERPARAMETERS and the STEPS are test_adamw.py's (adamw_helpers.py).
# The stored moments against the exact ones: each code is one of the two codes around its value, so the error
# is under one code step, 2^-mantissa_bits of the value's binade, or of 2^-14 of the block's scale below that
# (subnormal codes). Checked element by element in assert_within_one_code_step.
SHAPES = [(1,), (5,), (4095,), (33, 17), (256,), (257,)]


def _run_fused(param_dtypes, device, *, seed=7, grad_scale=None, steps=STEPS, block_size=256, shapes=SHAPES):
    """Params and optimizer after `steps` steps of FusedAdamW8bit on fixed random gradients."""
    return run_optimizer(
        lambda params: FusedAdamW8bit(params, **HYPERPARAMETERS, seed=seed, block_size=block_size),
        shapes, param_dtypes, device, steps=steps, grad_scale=grad_scale,
    )  # fmt: skip


def _run_reference(
    param_dtypes, device, *, seed=7, grad_scale=None, steps=STEPS, block_size=256, shapes=SHAPES
):
    """Params and state of each after `steps` reference steps on _run_fused's inputs."""

    def reference_step(params, grads, states, step):
        adamw8bit_step_reference(
            params, grads, states, step=step, **HYPERPARAMETERS, seed=seed, grad_scale=grad_scale,
            block_size=block_size,
        )  # fmt: skip

    return run_reference(
        lambda param: adamw8bit_zero_state(param, block_size), reference_step, shapes, param_dtypes, device,
        steps=steps,
    )  # fmt: skip


PARAM_DTYPE_SETS = [
    pytest.param([torch.bfloat16] * len(SHAPES), id="bf16"),
    pytest.param([torch.float32] * len(SHAPES), id="fp32"),
    # one group, two launches (bf16 and fp32 tensors); element offsets still count the whole group
    pytest.param([torch.bfloat16, torch.float32] * (len(SHAPES) // 2), id="mixed"),
]


@pytest.mark.parametrize("grad_scale", [None, 0.37], ids=["no-scale", "grad-scale"])
@pytest.mark.parametrize("param_dtypes", PARAM_DTYPE_SETS)
def test_kernel_matches_reference_exactly(param_dtypes, grad_scale, device):
    scale = None if grad_scale is None else torch.tensor(grad_scale, device=device)
    params, optimizer = _run_fused(param_dtypes, device, grad_scale=scale)
    assert_same_weights_and_state(params, optimizer, *_run_reference(param_dtypes, device, grad_scale=scale))
    for param in params:
        assert optimizer.state[param]["step"].item() == STEPS


def test_kernel_matches_reference_with_small_blocks(device):
    """32-element blocks: a 512-element program holds 16 of them, each with its own scales."""
    dtypes = [torch.bfloat16] * len(SHAPES)
    params, optimizer = _run_fused(dtypes, device, block_size=32)
    assert_same_weights_and_state(params, optimizer, *_run_reference(dtypes, device, block_size=32))
    assert optimizer.state[params[2]]["exp_avg_scales"].shape == (128,)  # ceil(4095 / 32)


def test_extreme_values_match_the_reference_and_stay_finite(device):
    """Gradients from 1e-30 to 1e15 in one block (v up to 1e30, sqrt(v) over 45 binades), a block of zeros and
    a block holding one non-zero element: the kernel still equals the reference, and nothing is NaN."""
    generator = torch.Generator().manual_seed(3)
    magnitudes = 10.0 ** torch.randint(-30, 16, (1024,), generator=generator).float()
    signs = torch.where(torch.rand(1024, generator=generator) < 0.5, -1.0, 1.0)
    grad = magnitudes * signs
    grad[256:512] = 0.0
    grad[512:768] = 0.0
    grad[700] = 1e-3
    grads = [grad.to(device), grad.to(device).bfloat16()]
    start = [
        torch.linspace(-2, 2, 1024, device=device),
        torch.linspace(-2, 2, 1024, device=device).bfloat16(),
    ]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    optimizer = FusedAdamW8bit(params, **HYPERPARAMETERS, seed=5)
    reference = [p.clone() for p in start]
    states = [adamw8bit_zero_state(p) for p in reference]
    for step in range(1, 4):
        step_on(params, optimizer, [g.clone() for g in grads])
        adamw8bit_step_reference(
            reference, [g.clone() for g in grads], states, step=step, **HYPERPARAMETERS, seed=5
        )
    assert_same_weights_and_state(params, optimizer, reference, states)
    for param in params:
        exp_avg, exp_avg_sq = dequantize_moments(optimizer.state[param])
        assert (
            torch.isfinite(param).all() and torch.isfinite(exp_avg).all() and torch.isfinite(exp_avg_sq).all()
        )
        assert (optimizer.state[param]["exp_avg_scales"][1] == 0) and (exp_avg[256:512] == 0).all()
        assert exp_avg[700] != 0 and (exp_avg[512:700] == 0).all()


def test_non_contiguous_gradients_are_read_and_non_contiguous_parameters_refused(device):
    params = [torch.nn.Parameter(torch.ones(33, 17, dtype=torch.bfloat16, device=device))]
    optimizer = FusedAdamW8bit(params, **HYPERPARAMETERS)
    grad = random_tensors([(17, 33)], torch.bfloat16, device, seed=2)[0]
    params[0].grad = grad.t()  # a transposed view: not contiguous
    optimizer.step()
    reference = [torch.ones(33, 17, dtype=torch.bfloat16, device=device)]
    states = [adamw8bit_zero_state(reference[0])]
    adamw8bit_step_reference(reference, [grad.t().contiguous()], states, step=1, **HYPERPARAMETERS)
    assert_same_weights_and_state(params, optimizer, reference, states)

    strided = torch.nn.Parameter(torch.ones(8, 8, device=device)[:, ::2])
    strided.grad = torch.ones_like(strided)
    with pytest.raises(ValueError, match="parameter 0 of its group is not contiguous"):
        FusedAdamW8bit([strided]).step()


# ----------------------------------------------------------------------------------------------------------
# The update and the codes
# ----------------------------------------------------------------------------------------------------------


def test_first_step_weights_are_fused_adamws_with_fp32_state(device):
    """From zero moments the first update uses the exact moments (quantization comes after it), so the weights
    are FusedAdamW's with fp32 state bit for bit: same update, same rounding bits."""
    dtypes = [torch.bfloat16] * len(SHAPES)
    params, _ = _run_fused(dtypes, device, steps=1)
    start = random_tensors(SHAPES, torch.bfloat16, device, seed=1)
    grads = random_tensors(SHAPES, torch.bfloat16, device, seed=100)
    exp_avgs = [torch.zeros_like(p, dtype=torch.float32) for p in start]
    exp_avg_sqs = [torch.zeros_like(p, dtype=torch.float32) for p in start]
    adamw_step_reference(start, grads, exp_avgs, exp_avg_sqs, step=1, **HYPERPARAMETERS, seed=7)
    for param, expected in zip(params, start, strict=True):
        torch.testing.assert_close(param.detach(), expected, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_follows_torch_adamw(param_dtype, device):
    """Each step of the reference is torch.optim.AdamW's from the same weights and the same (dequantized)
    moments within TOLERANCES, and the moments it stores are within one code step of torch's new ones."""
    start = random_tensors(SHAPES, torch.float32, device, seed=1)
    torch_params = [torch.nn.Parameter(p.to(param_dtype).float()) for p in start]
    torch_optimizer = torch.optim.AdamW(torch_params, **HYPERPARAMETERS)
    params = [p.detach().to(param_dtype) for p in start]
    states = [adamw8bit_zero_state(p) for p in params]
    atol, rtol = TOLERANCES[param_dtype]
    for step in range(1, STEPS + 2):
        grads = random_tensors(SHAPES, torch.float32, device, seed=100 + step)
        for torch_param, param, grad, state in zip(torch_params, params, grads, states, strict=True):
            torch_param.data.copy_(param.float())  # both start this step from the stored weights and moments
            torch_param.grad = grad.to(param_dtype).float()
            if step > 1:
                exp_avg, exp_avg_sq = dequantize_moments(state)
                torch_optimizer.state[torch_param]["exp_avg"].copy_(exp_avg)
                torch_optimizer.state[torch_param]["exp_avg_sq"].copy_(exp_avg_sq)
        torch_optimizer.step()
        adamw8bit_step_reference(
            params, [g.to(param_dtype) for g in grads], states, step=step, **HYPERPARAMETERS
        )
        for torch_param, param, state in zip(torch_params, params, states, strict=True):
            torch.testing.assert_close(param.float(), torch_param.detach(), atol=atol, rtol=rtol)
            exp_avg, exp_avg_sq = dequantize_moments(state)
            torch_state = torch_optimizer.state[torch_param]
            assert_within_one_code_step(
                exp_avg, torch_state["exp_avg"], state["exp_avg_scales"], EXP_AVG_MANTISSA_BITS
            )
            assert_within_one_code_step(
                exp_avg_sq.sqrt(), torch_state["exp_avg_sq"].sqrt(), state["exp_avg_sq_scales"],
                EXP_AVG_SQ_MANTISSA_BITS,
            )  # fmt: skip


def test_codes_decode_to_increasing_values_and_encode_back():
    """Every code of both formats: decoded values increase from 0 to 1.0, the top code; rounding with zero
    random bits (toward zero) gives the code back; 2^-14 is the first normal code."""
    for mantissa_bits in (EXP_AVG_MANTISSA_BITS, EXP_AVG_SQ_MANTISSA_BITS):
        codes = torch.arange(0, (15 << mantissa_bits) + 1)
        values = adamw8bit_module._decode_reference(codes, mantissa_bits)
        assert values[0] == 0.0 and values[-1] == 1.0 and torch.all(values[1:] > values[:-1])
        assert values[1 << mantissa_bits] == 2.0**-14
        encoded = adamw8bit_module._encode_reference(values, torch.zeros_like(codes), mantissa_bits)
        torch.testing.assert_close(encoded, codes, atol=0, rtol=0)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.85])
@pytest.mark.parametrize("mantissa_bits", [EXP_AVG_MANTISSA_BITS, EXP_AVG_SQ_MANTISSA_BITS])
def test_code_rounding_is_unbiased(mantissa_bits, fraction):
    """A value `fraction` of the way between two codes (normal and subnormal) is rounded up that often, from
    the kernel's random bits: the mean of 65536 rounded values is the value within 5 standard deviations."""
    index = torch.arange(1 << 16, dtype=torch.int64)
    first, _ = adamw_module._random_bits_reference(index, stochastic_rounding_key(0, 1))
    for low_code in (3, 37 << (mantissa_bits - 3)):
        low, high = adamw8bit_module._decode_reference(torch.tensor([low_code, low_code + 1]), mantissa_bits)
        value = torch.full(index.shape, float(low + fraction * (high - low)))
        codes = adamw8bit_module._encode_reference(value, first >> 16, mantissa_bits)
        assert set(codes.unique().tolist()) == {low_code, low_code + 1}
        rounded = adamw8bit_module._decode_reference(codes, mantissa_bits).double()
        sigma = float(high - low) * 0.5 / index.numel() ** 0.5
        assert abs(rounded.mean().item() - value[0].item()) <= 5 * sigma


def _second_moment_after_a_drop(device, steps_before=40, steps_after=160):
    """r = sqrt(v) of FusedAdamW8bit against the exact one, after half of the elements of every block (the odd
    ones) see their gradients drop 4x: their v must fall 16x, by under 1% a step (beta2 = 0.99), below a code's
    half step. Returns the mean ratio stored / exact over the dropped elements and over the others."""
    numel = 512
    param = torch.nn.Parameter(torch.zeros(numel, device=device))
    optimizer = FusedAdamW8bit([param], lr=0.0, betas=(0.9, 0.99), weight_decay=0.0, seed=1)
    generator = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(numel, generator=generator) * 0.5)
    exact = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps_before + steps_after):
        grad = torch.randn(numel, generator=generator) * scale
        if step >= steps_before:
            grad[1::2] *= 0.25
        exact = exact * 0.99 + grad.double() ** 2 * 0.01
        param.grad = grad.to(device)
        optimizer.step()
    _, exp_avg_sq = dequantize_moments(optimizer.state[param])
    ratio = (exp_avg_sq.cpu().double() / exact).sqrt()
    return ratio[1::2].mean().item(), ratio[0::2].mean().item()


def test_second_moment_follows_a_drop_of_the_gradients_in_its_block(device):
    """The reason the codes are rounded stochastically: v follows the gradients down. 160 steps after half of
    each block's gradients drop 4x, the stored sqrt(v) of those elements is 0.997 of the exact one on average;
    rounded to nearest (the mutant below) it is 1.21, their codes having stayed where they were."""
    dropped, kept = _second_moment_after_a_drop(device)
    assert abs(dropped - 1) < 0.1 and abs(kept - 1) < 0.1, (dropped, kept)


def test_same_seed_same_bits_other_seed_other_bits(device):
    dtypes = [torch.bfloat16] * len(SHAPES)
    first, first_optimizer = _run_fused(dtypes, device, seed=11, steps=2)
    again, again_optimizer = _run_fused(dtypes, device, seed=11, steps=2)
    other, other_optimizer = _run_fused(dtypes, device, seed=12, steps=2)
    assert_same_weights_and_state(again, again_optimizer, first, [first_optimizer.state[p] for p in first])
    for name in ("exp_avg_codes", "exp_avg_sq_codes"):
        changed = (
            (first_optimizer.state[first[2]][name] != other_optimizer.state[other[2]][name]).float().mean()
        )
        assert 0.05 < changed.item() < 0.95, (name, changed)  # some, not all, codes round the other way


def test_zero_learning_rate_leaves_bf16_weights_unchanged(device):
    adamw_helpers.assert_zero_learning_rate_leaves_bf16_weights_unchanged(FusedAdamW8bit, SHAPES, device)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")  # the control step's block maxima of NaN
def test_a_non_finite_norm_leaves_weights_and_state_as_they_are(device):
    params, optimizer = _run_fused([torch.bfloat16] * len(SHAPES), device, steps=1)
    assert_a_non_finite_norm_changes_nothing(params, optimizer, device)


# ----------------------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------------------


def test_state_dict_round_trip_resumes_exactly(device):
    """Saved (through torch.save / torch.load with weights_only) and loaded into a new optimizer: the codes stay
    uint8, the scales fp32 (torch.optim would cast both to bf16), and the next step is the same bit for bit."""
    params, optimizer = _run_fused([torch.bfloat16] * len(SHAPES), device, steps=2)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    copies, resumed = resume_on_copies(
        params, saved, lambda copies: FusedAdamW8bit(copies, **HYPERPARAMETERS, seed=7)
    )
    for param, copy in zip(params, copies, strict=True):
        state = resumed.state[copy]
        assert state["step"].item() == 2 and state["step"].device.type == "cpu"
        assert state["exp_avg_codes"].dtype == torch.uint8 and state["exp_avg_scales"].dtype == torch.float32
        for name, value in optimizer.state[param].items():
            torch.testing.assert_close(state[name], value, atol=0, rtol=0)
    grads = random_tensors(SHAPES, torch.float32, device, seed=102)
    step_on(params, optimizer, grads)
    step_on(copies, resumed, grads)
    assert_same_weights_and_state(copies, resumed, params, [optimizer.state[p] for p in params])


def test_the_trainers_full_state_dict_helpers_round_trip_the_state(device):
    """The checkpointer's get_optimizer_state_dict / set_optimizer_state_dict (full state, offloaded to the CPU
    as on rank 0) keep the codes uint8 and the scales fp32, exactly."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 7), torch.nn.Linear(7, 3)).to(device, torch.bfloat16)
        return model, FusedAdamW8bit(model.parameters(), lr=1e-2, seed=1)

    model, optimizer = model_and_optimizer()
    model(torch.randn(4, 300, dtype=torch.bfloat16, device=device)).float().sum().backward()
    optimizer.step()
    saved = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    resumed_model, resumed = model_and_optimizer()
    set_optimizer_state_dict(resumed_model, resumed, saved, options=StateDictOptions(full_state_dict=True))
    for param, copy in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert resumed.state[copy]["exp_avg_codes"].dtype == torch.uint8
        for name, value in optimizer.state[param].items():
            torch.testing.assert_close(resumed.state[copy][name], value, atol=0, rtol=0)


def test_another_block_size_is_converted_within_one_code_step(device):
    """A state saved with 256-element blocks, loaded by an optimizer of 64: every moment decoded against its new
    block lies within one code step of the saved one (the blocks of 64 see other maxima, so the codes change)."""
    params, optimizer = _run_fused([torch.bfloat16] * len(SHAPES), device, steps=2)
    resumed = FusedAdamW8bit(params, block_size=64)
    resumed.load_state_dict(optimizer.state_dict())
    changed = False
    for param in params:
        saved_exp_avg, saved_exp_avg_sq = dequantize_moments(optimizer.state[param])
        state = resumed.state[param]
        assert state["exp_avg_scales"].shape == (-(-param.numel() // 64),) and state["step"].item() == 2
        exp_avg, exp_avg_sq = dequantize_moments(state, block_size=64)
        assert_within_one_code_step(
            exp_avg, saved_exp_avg, state["exp_avg_scales"], EXP_AVG_MANTISSA_BITS, 64
        )
        assert_within_one_code_step(
            exp_avg_sq.sqrt(),
            saved_exp_avg_sq.sqrt(),
            state["exp_avg_sq_scales"],
            EXP_AVG_SQ_MANTISSA_BITS,
            64,
        )
        changed |= not torch.equal(state["exp_avg_codes"], optimizer.state[param]["exp_avg_codes"])
    assert changed


def test_a_state_that_cannot_be_converted_is_refused_with_the_reason(device):
    params, optimizer = _run_fused([torch.bfloat16] * len(SHAPES), device, steps=1)
    saved = optimizer.state_dict()
    other_shapes = [
        torch.nn.Parameter(torch.zeros(p.numel() + 1, dtype=p.dtype, device=device)) for p in params
    ]
    with pytest.raises(ValueError, match=r"has codes shaped \(1,\), and this parameter is shaped \(2,\)"):
        FusedAdamW8bit(other_shapes).load_state_dict(saved)
    # Scales that no block size of the 4095-element tensor gives (16 blocks of 256: 15 is none's).
    bad_scales = {**saved, "state": {**saved["state"], 2: {**saved["state"][2]}}}
    bad_scales["state"][2]["exp_avg_scales"] = bad_scales["state"][2]["exp_avg_scales"][:15]
    with pytest.raises(ValueError, match=r"scales shaped \(15,\) \(exp_avg\) and \(16,\) \(exp_avg_sq\)"):
        FusedAdamW8bit(params).load_state_dict(bad_scales)
    fused = FusedAdamW(params)
    for param in params:
        param.grad = torch.ones_like(param)
    fused.step()
    with pytest.raises(KeyError, match="has no \\['exp_avg_codes'"):
        FusedAdamW8bit(params).load_state_dict(fused.state_dict())


def test_state_bytes_per_parameter(device):
    assert adamw8bit_state_bytes_per_parameter() == 2.03125
    assert adamw8bit_state_bytes_per_parameter(2048) == 2 + 8 / 2048
    param = torch.nn.Parameter(torch.zeros(64, 256, dtype=torch.bfloat16, device=device))
    param.grad = torch.zeros_like(param)
    optimizer = FusedAdamW8bit([param], lr=0.0)
    optimizer.step()
    state_bytes = sum(v.numel() * v.element_size() for k, v in optimizer.state[param].items() if k != "step")
    assert state_bytes == param.numel() * adamw8bit_state_bytes_per_parameter()


one_process_group = adamw_helpers.one_process_group


def test_bad_arguments_are_refused_with_the_field(device):
    assert_bad_arguments_are_refused_with_the_field(FusedAdamW8bit, device)
    with pytest.raises(ValueError, match="block_size must be a power of two from 32 to 4096, got 100"):
        FusedAdamW8bit([torch.nn.Parameter(torch.ones(3))], block_size=100)


def test_fsdp2_state_on_host_is_refused_with_the_reason(one_process_group):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=one_process_group)
    with pytest.raises(TypeError, match="FSDP2 DTensor; state_on_host keeps whole tensors"):
        FusedAdamW8bit(model.parameters(), state_on_host=True)


@pytest.mark.slow
def test_two_fsdp2_ranks_update_their_shards_exactly_and_checkpoint(device):
    """Two gloo ranks under torchrun (tests/kernels/fsdp_adamw8bit_ranks.py): each rank's shard, its tail
    block masked, stepped bit for bit as the reference steps that shard alone; the state is the shard's; the
    full-state-dict helpers round-trip it exactly."""
    if device != "cpu":
        pytest.skip("gloo ranks on CPU tensors, which the kernel runs on only under the interpreter")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    completed = subprocess.run(
        [*command, str(root / "tests" / "kernels" / "fsdp_adamw8bit_ranks.py")],
        cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert "rank 0: ok" in output and "rank 1: ok" in output


def _torchrun(nproc: int, *arguments: str) -> None:
    """tests/kernels/fsdp_adamw8bit_reshard_ranks.py on `nproc` gloo ranks; every rank must report ok."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    completed = subprocess.run(
        [*command, "-m", "tests.kernels.fsdp_adamw8bit_reshard_ranks", *arguments],
        cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    assert all(f"rank {rank}: ok" in output for rank in range(nproc)), output[-4000:]


@pytest.fixture(scope="module")
def saved_by_two_fsdp2_ranks(tmp_path_factory):
    """The full state dict of FusedAdamW8bit after 3 steps on two FSDP2 ranks (blocks of 32 within each shard),
    as the trainer's checkpoints gather it, and the moments it holds, each rank's shard decoded against its own
    blocks (fsdp_adamw8bit_reshard_ranks.py's docstring)."""
    path = tmp_path_factory.mktemp("reshard") / "two_ranks.pt"
    _torchrun(2, "save", str(path))
    return torch.load(path, weights_only=True)


def _load_unsharded(saved, block_size: int) -> tuple[torch.nn.Module, FusedAdamW8bit]:
    """The two-rank state loaded by one unsharded optimizer through the trainer's full-state-dict helpers."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from tests.kernels.fsdp_adamw8bit_reshard_ranks import HYPERPARAMETERS, build_model

    model = build_model()
    optimizer = FusedAdamW8bit(model.parameters(), **HYPERPARAMETERS, block_size=block_size)
    optimizer.initialize_state()  # as the trainer's restore does
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, saved["optimizer"], options=options)
    return model, optimizer


def _assert_unsharded_load_within_one_code_step(saved, block_size: int) -> None:
    """Every moment of the loaded state, decoded against its new block, within one code step of the saved
    one (the moments two ranks saved, decoded against their own shards' blocks)."""
    model, optimizer = _load_unsharded(saved, block_size)
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        assert state["step"].item() == 3 and state["exp_avg_scales"].shape == (
            -(-param.numel() // block_size),
        )
        exp_avg, exp_avg_sq = dequantize_moments(state, block_size)
        saved_exp_avg, saved_root = saved["moments"][name]
        assert saved_root.abs().max() > 0, name
        assert_within_one_code_step(
            exp_avg, saved_exp_avg, state["exp_avg_scales"], EXP_AVG_MANTISSA_BITS, block_size
        )
        assert_within_one_code_step(
            exp_avg_sq.sqrt(), saved_root, state["exp_avg_sq_scales"], EXP_AVG_SQ_MANTISSA_BITS, block_size
        )


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [32, 64], ids=["same-blocks", "other-blocks"])
def test_a_two_rank_state_loads_unsharded_within_one_code_step(saved_by_two_fsdp2_ranks, block_size, device):
    """Two FSDP2 ranks' state resumed by one unsharded optimizer: the blocks of the whole tensor straddle the
    shards' (the (7, 37) weight's shard boundary at element 148, inside a 32-element block), so each moment is
    decoded in the saved blocks and encoded again in the tensor's; with blocks of 64, in another block size
    too. A step then runs on it."""
    if device != "cpu":
        pytest.skip("the saved state is the CPU ranks'")
    _assert_unsharded_load_within_one_code_step(saved_by_two_fsdp2_ranks, block_size)
    model, optimizer = _load_unsharded(saved_by_two_fsdp2_ranks, block_size)
    model(torch.randn(4, 37, dtype=torch.bfloat16)).float().square().sum().backward()
    optimizer.step()
    assert all(optimizer.state[p]["step"].item() == 4 for p in model.parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_a_two_rank_state_loads_on_three_ranks_within_one_code_step(
    saved_by_two_fsdp2_ranks, tmp_path, device
):
    """The same state resumed on three FSDP2 ranks (uneven shards: 3, 3 and 1 of the 7 rows), each rank checking
    its own shard's moments against the saved ones (fsdp_adamw8bit_reshard_ranks.py's load)."""
    if device != "cpu":
        pytest.skip("gloo ranks on CPU tensors, which the kernel runs on only under the interpreter")
    path = tmp_path / "two_ranks.pt"
    torch.save(saved_by_two_fsdp2_ranks, path)
    _torchrun(3, "load", str(path))


# A wrong conversion must fail the check above: m decoded without its sign, every element read against the
# neighbouring block's scale, and the saved shards' rows of scales read in the wrong order.
CONVERSION_MUTATIONS = [
    pytest.param("_decoded", "-magnitude, magnitude)", "magnitude, magnitude)", "m-sign-lost"),
    pytest.param("_saved_element_scales", "scales[shard, first_block:end_block]",
                 "scales[shard, first_block:end_block].roll(1)", "shifted-block"),
    pytest.param("_saved_element_scales", "scales[shard, first_block:end_block]",
                 "scales[-1 - shard, first_block:end_block]", "other-shards-row"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("function", "old", "new", "what"), CONVERSION_MUTATIONS, ids=[m.values[3] for m in CONVERSION_MUTATIONS]
)
def test_a_wrong_conversion_fails_the_one_code_step_check(
    saved_by_two_fsdp2_ranks, function, old, new, what, monkeypatch, device
):
    if device != "cpu":
        pytest.skip("the saved state is the CPU ranks'")
    mutant = mutated_function(getattr(adamw8bit_module, function), old, new)
    monkeypatch.setattr(adamw8bit_module, function, mutant)
    with pytest.raises(AssertionError, match="largest error / code step"):
        _assert_unsharded_load_within_one_code_step(saved_by_two_fsdp2_ranks, 32)


# ----------------------------------------------------------------------------------------------------------
# Mutation tests: a deliberately broken kernel must fail the tests above
# ----------------------------------------------------------------------------------------------------------

MUTATIONS = [
    pytest.param(("exp_avg = tl.where(m_code >= 0x80, -m_magnitude, m_magnitude)",
                  "exp_avg = tl.where(m_code >= 0x80, m_magnitude, -m_magnitude)"), "m-sign-flip"),
    pytest.param(("m_scale = tl.load(m_scales_ptr + blocks,", "m_scale = tl.load(r_scales_ptr + blocks,"),
                 "m-read-with-r-scales"),
    pytest.param(("tl.store(r_scales_ptr + blocks, new_r_scale",
                  "tl.store(r_scales_ptr + blocks // 2, new_r_scale"),
                 "wrong-block-index"),
    pytest.param(("offsets = blocks[:, None] * QUANT_BLOCK", "offsets = blocks[:, None] * (QUANT_BLOCK - 1)"),
                 "block-stride"),
    pytest.param(("mask = offsets < numel", "mask = offsets < numel - 1"), "off-by-one"),
    pytest.param(("grad = grad * grad_scale", "grad = grad * 1.0"), "grad-scale"),
    pytest.param(("* inv_sqrt_bias_correction2", "* 1.0"), "no-bias-correction"),
    pytest.param(("param * weight_decay_factor", "param"), "no-weight-decay"),
    pytest.param(("_encode(r_ratio, second & 0xFFFF", "_encode(r_ratio, first >> 16"), "correlated-bits"),
    pytest.param(("small = value < 6.103515625e-05", "small = value < 0.0"), "no-subnormal-codes"),
    pytest.param(("return tl.where(normal, value, value - 6.103515625e-05)", "return value"),
                 "subnormal-decode"),
    pytest.param(("_round_stochastic(param, first & 0xFFFF)", "_round_stochastic(param, first & 0x7FFF)"),
                 "biased-weight-bits"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "what"), MUTATIONS, ids=[m.values[1] for m in MUTATIONS])
def test_mutated_kernel_fails_the_exact_comparison(edit, what, tmp_path, monkeypatch, device):
    mutant = mutated_kernel(adamw8bit_module._adamw8bit_kernel, *edit, tmp_path, what.replace("-", "_"))
    monkeypatch.setattr(adamw8bit_module, "_adamw8bit_kernel", mutant)
    with pytest.raises(AssertionError):
        if what in ("no-subnormal-codes", "subnormal-decode"):
            test_extreme_values_match_the_reference_and_stay_finite(device)
        else:
            test_kernel_matches_reference_exactly([torch.bfloat16] * len(SHAPES), 0.37, device)


def test_round_to_nearest_codes_fail_the_drop_test(tmp_path, monkeypatch, device):
    """Codes rounded to nearest (half a step added instead of random bits) fail the test above."""
    mutant = mutated_kernel(
        adamw8bit_module._adamw8bit_kernel,
        "bits + (random16 << (7 - MANTISSA_BITS))",
        "bits + (0x8000 << (7 - MANTISSA_BITS))",
        tmp_path,
        "nearest",
    )
    monkeypatch.setattr(adamw8bit_module, "_adamw8bit_kernel", mutant)
    with pytest.raises(AssertionError):
        test_second_moment_follows_a_drop_of_the_gradients_in_its_block(device)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
def test_no_skip_guard_mutant_fails_the_non_finite_test(tmp_path, monkeypatch, device):
    mutant = mutated_kernel(
        adamw8bit_module._adamw8bit_kernel,
        "numel = tl.where(grad_scale == grad_scale, numel, 0)",
        "numel = numel",
        tmp_path,
    )
    monkeypatch.setattr(adamw8bit_module, "_adamw8bit_kernel", mutant)
    with pytest.raises(AssertionError):
        test_a_non_finite_norm_leaves_weights_and_state_as_they_are(device)


# ----------------------------------------------------------------------------------------------------------
# GPU: real sizes
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_kernel_matches_reference_exactly_at_real_sizes(device):
    adamw_helpers.assert_matches_reference_exactly_at_real_sizes(
        FusedAdamW8bit, adamw8bit_zero_state, adamw8bit_step_reference, device
    )


@pytest.mark.slow
def test_two_fsdp2_ranks_follow_the_unsharded_loss_curve_within_the_rounding_spread(device, tmp_path):
    """Two FSDP2 ranks against one unsharded process on the same global batches
    (tests/kernels/fsdp_adamw8bit_curve_ranks.py). The shards' blocks are not the whole tensor's and their
    rounding bits are drawn at other element indexes, so the curves are not bit-equal; each stored moment is
    still within one code step of its exact value, as in any unsharded run. The bound is the optimizer's own
    spread: the sharded curve lies no farther (largest difference over the steps) from the unsharded run of the
    same seed than unsharded runs that differ only in their rounding seed lie from one another. Two broken
    optimizers run beside it and must fall outside: one that forgets the second moment, and one that reads
    its codes against the neighbouring block's scale."""
    if device != "cpu":
        pytest.skip("gloo ranks on CPU tensors, which the kernel runs on only under the interpreter")
    import itertools
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "curves.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    completed = subprocess.run(
        [*command, str(root / "tests" / "kernels" / "fsdp_adamw8bit_curve_ranks.py"), str(out)],
        cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    curves = json.loads(out.read_text())
    one = curves["one"]

    def distance(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b)
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    spread = max(distance(one[a], one[b]) for a, b in itertools.combinations(one, 2))
    # The runs learn: the spread is measured on a falling curve, not on noise around a flat one.
    assert one["1"][-1] < one["1"][0] / 5
    assert 0 < distance(curves["fsdp"], one["1"]) <= spread, (curves["fsdp"], one["1"], spread)
    for name, curve in curves["mutants"].items():
        assert not distance(curve, one["1"]) <= spread, name  # NaN or inf count as outside
