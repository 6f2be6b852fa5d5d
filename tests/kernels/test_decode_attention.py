"""The grouped-query decoding kernel against its float32 reference (the cache widened to every query head).

Both see the same bfloat16/float16 inputs; the kernel rounds its probabilities to the input dtype before the
second dot and its output once, so they differ by about two roundings of the dtype. A kernel that paired
heads wrongly, dropped the mask, or skipped a block it should read misses by far more.
"""

import pytest
import torch

from fusetune.kernels import decode_attention as decode_module
from fusetune.kernels.decode_attention import (
    grouped_decode_attention,
    grouped_decode_attention_reference,
    grouped_decode_kernel_applies,
)
from tests.kernels.mutation import mutated_kernel

# (atol, rtol) against the float32 reference. The kernel rounds each probability to the cache's dtype before the
# p @ v product (relative error u = 2**-8 for bf16, 2**-11 for fp16), which moves the output by at most
# u * max|v| (sum p_i |v_i| / sum p_i); v ~ N(0, 1) over at most a few hundred slots stays under 4, so atol is
# u * 4 rounded up (bf16 1.6e-2 -> 2e-2, fp16 2e-3). rtol covers the output's own final rounding, u, twice.
TOLERANCES = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def _inputs(batch, heads, kv_heads, dim, length, dtype, device, seed=0, query_layout="projection"):
    generator = torch.Generator().manual_seed(seed)
    if query_layout == "projection":  # what attention layers pass: q_proj(x).view(b, 1, h, d).transpose(1, 2)
        query = torch.randn(batch, 1, heads, dim, generator=generator).transpose(1, 2)
    else:
        query = torch.randn(batch, heads, 1, dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator) for _ in range(2))
    return tuple(t.to(device=device, dtype=dtype) for t in (query, key, value))


def _static_cache_mask(batch, length, filled, padding, device, extra=0):
    """A static cache's mask: row r's first padding[r] slots are left padding, slots from `filled` on are not
    written yet; `extra` slots past the cache (transformers' masks may be longer than the keys)."""
    positions = torch.arange(length + extra)
    mask = (positions >= torch.tensor(padding).view(batch, 1)) & (positions < filled)
    return mask.view(batch, 1, 1, length + extra).to(device)


def _assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads, kv_heads, dim, length, filled, padding",
    [
        (8, 2, 64, 150, 131, [0, 70, 3]),  # a row's padding covers a whole 64-slot block; a part-filled tail
        (32, 8, 128, 40, 40, [5, 0, 1]),  # the Llama shape's heads; one block, part masked
        (6, 2, 80, 97, 90, [2, 0, 60]),  # head dim not a power of two, 3 query heads per KV head
        (8, 2, 8, 30, 25, [0, 2, 9]),  # head dim under a tensor-core dot's 16 (a tiny test model's)
    ],
)
def test_kernel_equals_the_reference_over_a_static_cache(
    heads, kv_heads, dim, length, filled, padding, dtype, device
):
    query, key, value = _inputs(3, heads, kv_heads, dim, length, dtype, device)
    mask = _static_cache_mask(3, length, filled, padding, device, extra=5)
    assert grouped_decode_kernel_applies(query, key, value, mask)
    actual = grouped_decode_attention(query, key, value, mask, scale=0.11)
    expected = grouped_decode_attention_reference(query, key, value, mask, scale=0.11)
    assert actual.shape == (3, 1, heads, dim)
    _assert_close(actual, expected, dtype)


def test_without_a_mask_every_slot_is_read_and_the_default_scale_is_head_dim(device):
    query, key, value = _inputs(2, 8, 4, 32, 70, torch.bfloat16, device, query_layout="contiguous")
    _assert_close(
        grouped_decode_attention(query, key, value, None),
        grouped_decode_attention_reference(query, key, value, None, scale=32**-0.5),
        torch.bfloat16,
    )


def test_a_mask_shared_by_all_rows(device):
    query, key, value = _inputs(3, 8, 2, 64, 90, torch.bfloat16, device, seed=1)
    mask = _static_cache_mask(1, 90, 77, [4], device)
    _assert_close(
        grouped_decode_attention(query, key, value, mask),
        grouped_decode_attention_reference(query, key, value, mask.expand(3, 1, 1, 90)),
        torch.bfloat16,
    )


def test_slots_the_mask_drops_are_never_read(device):
    """NaN in every dropped slot (left padding, slots not yet written) leaves the output finite and equal to
    the reference's over the kept slots: a masked score alone would still multiply a NaN value by 0."""
    query, key, value = _inputs(3, 8, 2, 64, 150, torch.bfloat16, device, seed=2)
    mask = _static_cache_mask(3, 150, 131, [0, 70, 3], device)
    poisoned_key, poisoned_value = (
        t.masked_fill(~mask.view(3, 1, 150, 1), float("nan")) for t in (key, value)
    )
    actual = grouped_decode_attention(query, poisoned_key, poisoned_value, mask)
    assert torch.isfinite(actual).all()
    _assert_close(actual, grouped_decode_attention_reference(query, key, value, mask), torch.bfloat16)


def test_a_row_with_no_kept_slot_gets_zeros(device):
    query, key, value = _inputs(2, 8, 2, 32, 20, torch.float16, device)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool, device=device)
    mask[1] = False
    actual = grouped_decode_attention(query, key, value, mask)
    assert torch.equal(actual[1].float(), torch.zeros_like(actual[1].float()))
    _assert_close(actual[0], grouped_decode_attention_reference(query, key, value, mask)[0], torch.float16)


def test_what_the_kernel_does_not_take():
    query, key, value = _inputs(2, 8, 2, 32, 20, torch.bfloat16, "cpu")
    boolean = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    assert grouped_decode_kernel_applies(query, key, value, boolean)
    assert not grouped_decode_kernel_applies(query.float(), key.float(), value.float(), None)  # float32
    assert not grouped_decode_kernel_applies(query, key, value, torch.zeros(2, 1, 1, 20))  # additive mask
    assert not grouped_decode_kernel_applies(query, key, value, boolean[..., :19])  # shorter than the cache
    three_tokens = query.expand(2, 8, 3, 32)
    assert not grouped_decode_kernel_applies(three_tokens, key, value, None)
    assert not grouped_decode_kernel_applies(query[:, :7], key, value, None)  # 7 query heads over 2
    with pytest.raises(ValueError, match="unsupported inputs"):
        grouped_decode_attention(query.float(), key.float(), value.float(), None)


@pytest.mark.parametrize(
    "old, new, why",
    [
        ("heads = kv_head * GROUP + offs_g", "heads = kv_head + offs_g * n_kv_heads",
         "query heads interleaved across KV heads instead of consecutive"),
        ("keep = keep & (tl.load(", "keep = keep | (tl.load(", "the mask ignored"),
        ("alpha = tl.exp2(m_i - m_new)", "alpha = tl.exp2(m_i - m_i)", "the running sums not rescaled"),
    ],
)  # fmt: skip
def test_a_wrong_kernel_is_caught(old, new, why, tmp_path, device, monkeypatch):
    query, key, value = _inputs(3, 8, 2, 64, 150, torch.bfloat16, device, seed=4)
    mask = _static_cache_mask(3, 150, 131, [0, 70, 3], device)
    expected = grouped_decode_attention_reference(query, key, value, mask)
    monkeypatch.setattr(decode_module, "_grouped_decode_kernel", mutated_kernel(
        decode_module._grouped_decode_kernel, old, new, tmp_path))  # fmt: skip
    actual = grouped_decode_attention(query, key, value, mask)
    with pytest.raises(AssertionError):
        _assert_close(actual, expected, torch.bfloat16)


@pytest.mark.gpu
def test_kernel_under_torch_compile_at_the_llama_shape():
    """The op as Hugging Face's compiled decoding step meets it: 64 rows, 32 query heads over 8, a 528-slot
    static cache, compiled with fullgraph."""
    query, key, value = _inputs(64, 32, 8, 64, 528, torch.bfloat16, "cuda", seed=5)
    mask = _static_cache_mask(64, 528, 300, [i % 17 for i in range(64)], "cuda")
    compiled = torch.compile(grouped_decode_attention, fullgraph=True)
    _assert_close(compiled(query, key, value, mask), grouped_decode_attention_reference(query, key, value, mask),
                  torch.bfloat16)  # fmt: skip
