"""RoPE kernel against its pure-PyTorch reference and transformers' apply_rotary_pos_emb.

The kernel and the reference both compute in fp32 from the same inputs and round once to the input dtype, so
outputs and gradients may differ by about one rounding of the dtype. cos/sin come either from a real rotary
embedding (both halves equal) or are random with independent halves: only the latter catch a backward that is
the forward with sin negated instead of the exact transpose.
"""

import importlib.util
import inspect
import itertools

import pytest
import torch

from fusetune.kernels import rope as rope_module
from fusetune.kernels.rope import apply_rotary_pos_emb, rope_reference

# (atol, rtol) per dtype: one rounding of the dtype (bf16 keeps 8 significant bits, fp16 11) plus fp32 noise.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}
DTYPES = list(TOLERANCES)


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _rotary_angles(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0):
    """cos/sin as transformers' rotary embeddings build them (halves equal), for integer positions [...]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _randn(*shape, device, seed):
    # Drawn on the test device: real-size GPU cases would spend seconds drawing on the CPU.
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=generator, device=device)


def _angles(cos_batch: int, seq_len: int, rotary_dim: int, kind: str, dtype, device, seed: int = 3):
    if kind == "rotary":
        # Positions that do not start at 0 and differ per batch row, so a wrong row/batch index shows.
        start = torch.randint(0, 50, (cos_batch, 1), generator=torch.Generator().manual_seed(seed))
        cos, sin = _rotary_angles(start + torch.arange(seq_len), rotary_dim)
    else:
        cos = _randn(cos_batch, seq_len, rotary_dim, device=device, seed=seed)
        sin = _randn(cos_batch, seq_len, rotary_dim, device=device, seed=seed + 100)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def _projection(batch, seq_len, heads, head_dim, dtype, device, seed):
    """A [B, S, H*D] leaf standing for a projection's output."""
    x = _randn(batch, seq_len, heads * head_dim, device=device, seed=seed)
    return x.to(dtype=dtype).requires_grad_(True)


def _as_heads(x: torch.Tensor, heads: int, path: str) -> torch.Tensor:
    """q/k as attention layers pass them, from a [B, S, H*D] leaf.

    "projection": non-leaf transposed view (the HF layout; in-place path); "leaf": a leaf view (out-of-place
    path); "strided": a non-contiguous slice of a wider non-leaf tensor (out-of-place path, arbitrary strides);
    "strided-d": like "strided" with stride 2 along head_dim.
    """
    batch, seq_len, width = x.shape
    head_dim = width // heads
    if path == "projection":
        return (x * 1).view(batch, seq_len, heads, head_dim).transpose(1, 2)
    if path == "leaf":
        return x.view(batch, seq_len, heads, head_dim).transpose(1, 2)
    if path == "strided":
        wide = torch.cat((x * 1, x.detach()[..., :5]), dim=-1)
        return wide[..., :width].view(batch, seq_len, heads, head_dim).transpose(1, 2)
    if path == "strided-d":
        # Every other element of a wider tensor: stride 2 along head_dim.
        interleaved = torch.stack((x * 1, x.detach()), dim=-1)[..., 0]
        return interleaved.view(batch, seq_len, heads, head_dim).transpose(1, 2)
    raise ValueError(path)


def _run_rope(fn, q_proj, k_proj, n_q, n_kv, cos, sin, path, grads, **kwargs):
    q = _as_heads(q_proj, n_q, path)
    k = _as_heads(k_proj, n_kv, path)
    q_embed, k_embed = fn(q, k, cos, sin, **kwargs)
    torch.autograd.backward((q_embed, k_embed), grads)
    return q_embed.detach().clone(), k_embed.detach().clone()


def _check_rope(batch, seq_len, n_q, n_kv, head_dim, rotary_dim, cos_batch, kind, path, dtype, device):
    cos, sin = _angles(cos_batch, seq_len, rotary_dim, kind, dtype, device)
    q_proj = _projection(batch, seq_len, n_q, head_dim, dtype, device, seed=1)
    k_proj = _projection(batch, seq_len, n_kv, head_dim, dtype, device, seed=2)
    q_proj_ref = q_proj.detach().clone().requires_grad_(True)
    k_proj_ref = k_proj.detach().clone().requires_grad_(True)
    grads = (
        _randn(batch, n_q, seq_len, head_dim, device=device, seed=4).to(dtype),
        _randn(batch, n_kv, seq_len, head_dim, device=device, seed=5).to(dtype),
    )
    q_embed, k_embed = _run_rope(apply_rotary_pos_emb, q_proj, k_proj, n_q, n_kv, cos, sin, path, grads)
    q_ref, k_ref = _run_rope(rope_reference, q_proj_ref, k_proj_ref, n_q, n_kv, cos, sin, path, grads)
    _assert_matches(q_embed, q_ref, dtype)
    _assert_matches(k_embed, k_ref, dtype)
    _assert_matches(q_proj.grad, q_proj_ref.grad, dtype)
    _assert_matches(k_proj.grad, k_proj_ref.grad, dtype)


# (batch, seq_len, q heads, kv heads, head_dim, rotary_dim, cos batch: 1 or batch, angles)
# Interpreted kernels cost ~50 ms per program on CPU: shapes stay at a handful of tokens.
CASES = [
    pytest.param(2, 3, 4, 2, 64, 64, 2, "random", id="gqa-oddS-cosB"),
    pytest.param(2, 1, 4, 2, 64, 64, 1, "rotary", id="one-token-cos1"),
    pytest.param(1, 3, 4, 2, 64, 32, 1, "random", id="partial-rotary-32of64"),
    pytest.param(2, 2, 3, 1, 128, 96, 2, "rotary", id="mqa-oddheads-rot96of128"),
    # Head counts that are not powers of two; 2 tokens per program, so S=5 leaves a half-empty last program.
    pytest.param(2, 5, 6, 3, 64, 64, 1, "random", id="heads6-3-S5"),
]
CASE_ARGS = ("batch", "seq_len", "n_q", "n_kv", "head_dim", "rotary_dim", "cos_batch", "kind")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(CASE_ARGS, CASES)
def test_in_place_path_matches_reference(
    batch, seq_len, n_q, n_kv, head_dim, rotary_dim, cos_batch, kind, dtype, device
):
    """q/k as transposed views of projection outputs: rotated in place."""
    _check_rope(batch, seq_len, n_q, n_kv, head_dim, rotary_dim, cos_batch, kind, "projection", dtype, device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(CASE_ARGS, [CASES[0], CASES[2]])
def test_out_of_place_path_matches_reference(
    batch, seq_len, n_q, n_kv, head_dim, rotary_dim, cos_batch, kind, dtype, device
):
    """Leaf q/k: the registered functional op and its registered autograd formula."""
    _check_rope(batch, seq_len, n_q, n_kv, head_dim, rotary_dim, cos_batch, kind, "leaf", dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs_and_head_dim_256(dtype, device):
    _check_rope(1, 3, 2, 1, 256, 256, 1, "random", "strided", dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stride_along_head_dim(dtype, device):
    _check_rope(2, 3, 3, 2, 64, 48, 2, "random", "strided-d", dtype, device)


@pytest.mark.parametrize("path", ["projection", "leaf"])
def test_several_head_steps_and_tokens_per_program(path, monkeypatch, device):
    """Tiles smaller than a token (3 head steps) and 8 tokens per program (S=5: a partly empty program)."""
    monkeypatch.setattr(rope_module, "_MAX_PAIRS_PER_TILE", 64)
    monkeypatch.setattr(rope_module, "_MIN_PAIRS_PER_PROGRAM", 1 << 20)
    settings = rope_module.rope_launch_settings(6, 3, 48)
    assert settings.head_blocks == 3 and settings.tokens_per_program == 8
    _check_rope(2, 5, 6, 3, 64, 48, 2, "random", path, torch.float32, device)


def test_int64_offsets(monkeypatch, device):
    """The int64 index path (taken for tensors of 2**31 elements or more), forced at a small shape."""
    monkeypatch.setattr(rope_module, "_INT32_OFFSET_LIMIT", 0)
    _check_rope(2, 3, 3, 1, 64, 64, 2, "random", "projection", torch.float32, device)
    cos_table, sin_table = _rotary_angles(torch.arange(16), 64)
    cos_table, sin_table = cos_table.to(device), sin_table.to(device)
    position_ids = torch.tensor([[3, 0, 9], [1, 15, 2]], device=device)
    q = _randn(2, 3, 3, 64, device=device, seed=7)
    k = _randn(2, 1, 3, 64, device=device, seed=8)
    expected = rope_reference(q, k, cos_table[position_ids], sin_table[position_ids])
    actual = apply_rotary_pos_emb(q.clone(), k.clone(), cos_table, sin_table, position_ids)
    _assert_matches(actual[0], expected[0], torch.float32)
    _assert_matches(actual[1], expected[1], torch.float32)


def test_launch_settings_cover_every_head():
    """Head steps times heads per step cover all heads, tiles stay within their cap, warps within 1..8."""
    for n_q, n_kv, rotary_dim in itertools.product(
        (1, 3, 6, 8, 14, 28, 32, 40, 64, 128), (1, 2, 3, 8), (32, 64, 96, 128, 256)
    ):
        settings = rope_module.rope_launch_settings(n_q, n_kv, rotary_dim)
        block_half = 1 << (rotary_dim // 2 - 1).bit_length()
        assert settings.head_blocks * settings.block_q_heads >= n_q
        assert settings.head_blocks * settings.block_k_heads >= n_kv
        assert max(settings.block_q_heads, settings.block_k_heads) * block_half <= max(
            rope_module._MAX_PAIRS_PER_TILE, block_half
        )
        assert settings.num_warps in (1, 2, 4, 8) and 1 <= settings.tokens_per_program <= 8
    main = rope_module.rope_launch_settings(32, 8, 128)
    assert (main.head_blocks, main.tokens_per_program) == (1, 1)  # one program per token, one step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_heads_second_layout(dtype, device):
    """unsqueeze_dim=2: q/k as [B, S, H, D], cos/sin unsqueezed at dim 2."""
    batch, seq_len, n_q, n_kv, head_dim = 2, 3, 4, 2, 64
    cos, sin = _angles(batch, seq_len, head_dim, "random", dtype, device)
    grads = (
        torch.randn(batch, seq_len, n_q, head_dim, device=device, dtype=dtype),
        torch.randn(batch, seq_len, n_kv, head_dim, device=device, dtype=dtype),
    )
    q_proj = _projection(batch, seq_len, n_q, head_dim, dtype, device, seed=1)
    k_proj = _projection(batch, seq_len, n_kv, head_dim, dtype, device, seed=2)
    q_ref_proj = q_proj.detach().clone().requires_grad_(True)
    k_ref_proj = k_proj.detach().clone().requires_grad_(True)
    results = []
    for fn, qp, kp in ((apply_rotary_pos_emb, q_proj, k_proj), (rope_reference, q_ref_proj, k_ref_proj)):
        q = (qp * 1).view(batch, seq_len, n_q, head_dim)
        k = (kp * 1).view(batch, seq_len, n_kv, head_dim)
        q_embed, k_embed = fn(q, k, cos, sin, unsqueeze_dim=2)
        assert q_embed.shape == q.shape and k_embed.shape == k.shape
        torch.autograd.backward((q_embed, k_embed), grads)
        results.append((q_embed.detach(), k_embed.detach()))
    _assert_matches(results[0][0], results[1][0], dtype)
    _assert_matches(results[0][1], results[1][1], dtype)
    _assert_matches(q_proj.grad, q_ref_proj.grad, dtype)
    _assert_matches(k_proj.grad, k_ref_proj.grad, dtype)


def test_matches_transformers(device):
    """Same result as transformers' own apply_rotary_pos_emb with its rotary embedding's cos/sin."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0)
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(device)
    batch, seq_len, head_dim = 2, 3, 64
    hidden = torch.randn(batch, seq_len, 256, device=device)
    position_ids = torch.tensor([[0, 1, 2], [7, 8, 9]], device=device)
    cos, sin = rotary(hidden, position_ids)
    q = torch.randn(batch, 4, seq_len, head_dim, device=device)
    k = torch.randn(batch, 2, seq_len, head_dim, device=device)
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    actual = apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin)
    _assert_matches(actual[0], expected[0], torch.float32)
    _assert_matches(actual[1], expected[1], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_position_ids_gather_from_table(dtype, device):
    """Packed sequences: positions restart inside a row; cos/sin are a [max_position, R] table."""
    batch, seq_len, n_q, n_kv, head_dim = 2, 5, 2, 1, 64
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [5, 6, 0, 1, 0]], device=device)
    cos_table, sin_table = _rotary_angles(torch.arange(16), head_dim)
    cos_table, sin_table = cos_table.to(device=device, dtype=dtype), sin_table.to(device=device, dtype=dtype)
    q_proj = _projection(batch, seq_len, n_q, head_dim, dtype, device, seed=1)
    k_proj = _projection(batch, seq_len, n_kv, head_dim, dtype, device, seed=2)
    q_ref_proj = q_proj.detach().clone().requires_grad_(True)
    k_ref_proj = k_proj.detach().clone().requires_grad_(True)
    grads = (
        torch.randn(batch, n_q, seq_len, head_dim, device=device, dtype=dtype),
        torch.randn(batch, n_kv, seq_len, head_dim, device=device, dtype=dtype),
    )
    q_embed, k_embed = _run_rope(
        apply_rotary_pos_emb, q_proj, k_proj, n_q, n_kv, cos_table, sin_table, "projection", grads,
        position_ids=position_ids,
    )  # fmt: skip
    # The reference gathers the rows itself: the HF (<4.38) form cos[position_ids].
    q_ref, k_ref = _run_rope(
        rope_reference, q_ref_proj, k_ref_proj, n_q, n_kv, cos_table[position_ids], sin_table[position_ids],
        "projection", grads,
    )  # fmt: skip
    _assert_matches(q_embed, q_ref, dtype)
    _assert_matches(k_embed, k_ref, dtype)
    _assert_matches(q_proj.grad, q_ref_proj.grad, dtype)
    _assert_matches(k_proj.grad, k_ref_proj.grad, dtype)
    # position_ids shared by the batch ([S]) broadcast like [1, S]. Tensors that need no grad are rotated in
    # place, hence the clones.
    q, k = _as_heads(q_proj.detach(), n_q, "leaf"), _as_heads(k_proj.detach(), n_kv, "leaf")
    expected = rope_reference(q, k, cos_table[position_ids[:1]], sin_table[position_ids[:1]])
    shared = apply_rotary_pos_emb(q.clone(), k.clone(), cos_table, sin_table, position_ids[0])
    _assert_matches(shared[0], expected[0], dtype)
    _assert_matches(shared[1], expected[1], dtype)


def test_in_place_only_where_allowed(device):
    """Projection views are rotated in their own storage; leaves and inputs that share memory are not touched."""
    batch, seq_len, n_q, n_kv, head_dim = 1, 4, 2, 2, 64
    cos, sin = _angles(1, seq_len, head_dim, "random", torch.float32, device)
    q_proj = _projection(batch, seq_len, n_q, head_dim, torch.float32, device, seed=1)
    k_proj = _projection(batch, seq_len, n_kv, head_dim, torch.float32, device, seed=2)

    q, k = _as_heads(q_proj, n_q, "projection"), _as_heads(k_proj, n_kv, "projection")
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_embed.data_ptr() == q.data_ptr() and k_embed.data_ptr() == k.data_ptr()
    assert q_embed.stride() == q.stride()

    q_leaf, k_leaf = _as_heads(q_proj, n_q, "leaf"), _as_heads(k_proj, n_kv, "leaf")
    before = q_proj.detach().clone()
    q_embed, _ = apply_rotary_pos_emb(q_leaf, k_leaf, cos, sin)
    assert q_embed.data_ptr() != q_leaf.data_ptr()
    assert q_embed.stride() == q_leaf.stride()  # out-of-place output keeps the [B, S, H, D] layout
    assert torch.equal(q_proj.detach(), before)

    q, k = _as_heads(q_proj, n_q, "projection"), _as_heads(k_proj, n_kv, "projection")
    q_keep = q.detach().clone()
    apply_rotary_pos_emb(q, k, cos, sin, inplace=False)
    assert torch.equal(q.detach(), q_keep)

    # The same tensor as q and k: both results must be rotated once.
    with torch.no_grad():
        x = torch.randn(batch, n_q, seq_len, head_dim, device=device)
        expected = rope_reference(x, x, cos, sin)
        q_embed, k_embed = apply_rotary_pos_emb(x, x, cos, sin)
    _assert_matches(q_embed, expected[0], torch.float32)
    _assert_matches(k_embed, expected[1], torch.float32)


def test_in_place_gradient_routes(device):
    """In-place path: heads-major incoming gradients, an unused k, and the caller's old view used afterwards."""
    batch, seq_len, n_q, n_kv, head_dim = 2, 3, 3, 2, 64
    dtype = torch.float32
    cos, sin = _angles(batch, seq_len, head_dim, "random", dtype, device)
    grad_q = _randn(batch, n_q, seq_len, head_dim, device=device, seed=4)  # contiguous [B, H, S, D]
    for route in ("heads-major-grad", "k-unused", "old-view-used"):
        leaves = [
            _projection(batch, seq_len, n, head_dim, dtype, device, seed=s) for n, s in ((n_q, 1), (n_kv, 2))
        ]
        leaves_ref = [x.detach().clone().requires_grad_(True) for x in leaves]
        for fn, (q_proj, k_proj) in ((apply_rotary_pos_emb, leaves), (rope_reference, leaves_ref)):
            q, k = _as_heads(q_proj, n_q, "projection"), _as_heads(k_proj, n_kv, "projection")
            q_embed, k_embed = fn(q, k, cos, sin)
            loss = (q_embed.contiguous() * grad_q).sum()
            if route == "heads-major-grad":
                loss = loss + k_embed.contiguous().square().sum()
            elif route == "old-view-used":
                # q (the caller's view of the projection) holds the rotated values after the in-place call.
                loss = loss + (q_embed if fn is rope_reference else q).square().sum()
            loss.backward()
        for actual, expected in zip(leaves, leaves_ref, strict=True):
            # An unused k has no gradient in the reference; the fused op, which owns q and k together, gives zeros.
            expected_grad = torch.zeros_like(expected) if expected.grad is None else expected.grad
            _assert_matches(actual.grad, expected_grad, dtype)


def test_saved_input_overwritten_in_place_fails_loudly(device):
    """If something saved q's old values for its backward, the in-place path must raise, not corrupt."""
    batch, seq_len, heads, head_dim = 1, 3, 2, 64
    cos, sin = _angles(1, seq_len, head_dim, "random", torch.float32, device)
    proj = _projection(batch, seq_len, heads, head_dim, torch.float32, device, seed=1)
    base = proj * 1
    saved_user = base.square()  # saves base for its backward
    q = base.view(batch, seq_len, heads, head_dim).transpose(1, 2)
    k = (proj * 1).view(batch, seq_len, heads, head_dim).transpose(1, 2)
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (q_embed.sum() + k_embed.sum() + saved_user.sum()).backward()


def test_rejects_inputs_it_cannot_handle(device):
    q = torch.randn(1, 2, 3, 64, device=device)
    k = torch.randn(1, 1, 3, 64, device=device)
    cos, sin = _angles(1, 3, 64, "random", torch.float32, device)
    with pytest.raises(ValueError, match="even"):
        apply_rotary_pos_emb(q, k, cos[..., :63], sin[..., :63])
    with pytest.raises(ValueError, match="seq_len=3"):
        apply_rotary_pos_emb(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="2-D table"):
        apply_rotary_pos_emb(q, k, cos, sin, position_ids=torch.arange(3, device=device))
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rotary_pos_emb(q, k, cos.requires_grad_(), sin)


# ----------------------------------------------------------------------------------------------------------
# Mutation tests: a deliberately broken kernel must fail the same comparisons.
# ----------------------------------------------------------------------------------------------------------

_KERNEL_CHAIN = [
    "_rotate_and_store",
    "_copy_pass_through",
    "_rope_kernel",
]
_mutant_ids = itertools.count()


def _load_mutant(old: str, new: str, tmp_path):
    """Fresh copies of the rope kernels with one source edit (a fresh module, so no compiled-kernel cache hit)."""
    source = "\n\n".join(inspect.getsource(getattr(rope_module, name).fn) for name in _KERNEL_CHAIN)
    assert source.count(old) == 1, f"mutation target not found exactly once: {old!r}"
    name = f"rope_mutant_{next(_mutant_ids)}"
    path = tmp_path / f"{name}.py"
    path.write_text(
        "import triton\nimport triton.language as tl\n\n"
        "from fusetune.kernels._interpreter import round_to_dtype\n\n\n" + source.replace(old, new)
    )
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MUTATIONS = [
    pytest.param("y_lo = x_lo * cos_lo - x_hi * sin_lo", "y_lo = x_lo * cos_lo + x_hi * sin_lo", "projection",
                 id="forward-sign-flip"),
    # The "forward with sin negated" shortcut: right only when both halves of sin are equal.
    pytest.param("sin_lo = -sin_second.to", "sin_lo = -sin_first.to", "projection",
                 id="backward-wrong-half-of-sin"),
    pytest.param("if COPY_PASS:", "if False:", "leaf", id="pass-through-dropped"),
    pytest.param("q_head_mask = (q_heads < N_Q_HEADS)", "q_head_mask = (q_heads < N_Q_HEADS - 1)", "projection",
                 id="last-q-head-masked-off"),
    pytest.param("k_head_mask = (k_heads < N_K_HEADS)", "k_head_mask = (k_heads < N_K_HEADS - 1)", "projection",
                 id="last-kv-head-masked-off"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "path"), MUTATIONS)
def test_mutated_kernel_fails(old, new, path, tmp_path, monkeypatch, device):
    mutant = _load_mutant(old, new, tmp_path)
    monkeypatch.setattr(rope_module, "_rope_kernel", mutant._rope_kernel)
    with pytest.raises(AssertionError):
        _check_rope(1, 3, 2, 1, 64, 32, 1, "random", path, torch.float32, device)


# ----------------------------------------------------------------------------------------------------------
# torch.compile (the registered ops and their fake implementations); GPU: Inductor and real sizes
# ----------------------------------------------------------------------------------------------------------


def _check_compiled(path, device, dtype, backend):
    batch, seq_len, n_q, n_kv, head_dim, rotary_dim = 2, 33, 8, 2, 128, 64
    cos, sin = _angles(batch, seq_len, rotary_dim, "random", dtype, device)
    q_proj = _projection(batch, seq_len, n_q, head_dim, dtype, device, seed=1)
    k_proj = _projection(batch, seq_len, n_kv, head_dim, dtype, device, seed=2)
    q_ref_proj = q_proj.detach().clone().requires_grad_(True)
    k_ref_proj = k_proj.detach().clone().requires_grad_(True)
    grads = (
        torch.randn(batch, n_q, seq_len, head_dim, device=device, dtype=dtype),
        torch.randn(batch, n_kv, seq_len, head_dim, device=device, dtype=dtype),
    )
    torch._dynamo.reset()
    compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True, backend=backend)
    q_embed, k_embed = _run_rope(compiled, q_proj, k_proj, n_q, n_kv, cos, sin, path, grads)
    q_ref, k_ref = _run_rope(rope_reference, q_ref_proj, k_ref_proj, n_q, n_kv, cos, sin, path, grads)
    _assert_matches(q_embed, q_ref, dtype)
    _assert_matches(k_embed, k_ref, dtype)
    _assert_matches(q_proj.grad, q_ref_proj.grad, dtype)
    _assert_matches(k_proj.grad, k_ref_proj.grad, dtype)


@pytest.mark.parametrize("path", ["projection", "leaf"])
def test_traces_with_fullgraph_aot_eager(path, device):
    """Dynamo + AOTAutograd through the registered ops and their fake implementations (CPU-safe backend)."""
    _check_compiled(path, device, torch.float32, "aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["projection", "leaf"])
def test_compiled_fullgraph(path, device):
    _check_compiled(path, device, torch.bfloat16, "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("batch", "seq_len", "n_q", "n_kv", "head_dim", "rotary_dim", "kind"),
    [
        pytest.param(8, 2048, 32, 8, 128, 128, "rotary", id="llama-8x2048"),
        pytest.param(2, 1023, 16, 4, 256, 128, "random", id="d256-partial"),
        pytest.param(3, 511, 28, 4, 64, 64, "random", id="d64-28heads"),
    ],
)
def test_real_sizes(batch, seq_len, n_q, n_kv, head_dim, rotary_dim, kind, dtype, device):
    _check_rope(batch, seq_len, n_q, n_kv, head_dim, rotary_dim, batch, kind, "projection", dtype, device)
