"""fusetune_varlen attention: sequence boundaries from position ids, the model's outputs on packed and padded
rows equal to sdpa with transformers' masks, and the switch that apply_fusetune makes (and reverts).

On a CPU the flash kernel cannot run, so the model-level tests swap in a per-sequence reference for it: what
they check is everything around the kernel (the boundaries, the [batch, heads, seq, dim] <-> [tokens, heads,
dim] layouts, grouped-query heads, the keywords reaching every layer). The kernel itself is compared with
sdpa on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusetune.models import apply_fusetune, revert_fusetune
from fusetune.models import attention as attention_module
from fusetune.models.attention import VARLEN_ATTENTION, packed_sequence_kwargs
from fusetune.worker.train.data import model_inputs


def test_boundaries_start_where_positions_restart_and_at_every_row():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 0, 1]])
    kwargs = packed_sequence_kwargs(position_ids)
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 4
    assert isinstance(kwargs["max_length_q"], int)  # a host value: reading it never waits for a GPU


def test_a_single_unpacked_row_is_one_sequence():
    kwargs = packed_sequence_kwargs(torch.arange(7).unsqueeze(0))
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 7]
    assert kwargs["max_length_q"] == 7


def reference_varlen(query, key, value, cu_seq_lens, max_length, scale):
    """Causal attention per sequence of [tokens, heads, dim] tensors, grouped-query heads repeated."""
    groups = query.shape[1] // key.shape[1]
    outputs = []
    bounds = cu_seq_lens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outputs)


@pytest.fixture
def reference_kernel(monkeypatch):
    """Runs the varlen path on the CPU with `reference_varlen` in place of the flash kernel; counts calls."""
    calls = []

    def applies(query, key, dropout, kwargs):
        return kwargs.get("cu_seq_lens_q") is not None and query.shape[1] % key.shape[1] == 0

    def kernel(query, key, value, cu_seq_lens, max_length, scale):
        calls.append(max_length)
        return reference_varlen(query, key, value, cu_seq_lens, max_length, scale)

    monkeypatch.setattr(attention_module, "varlen_kernel_applies", applies)
    monkeypatch.setattr(attention_module._VarlenFlashAttention, "apply", staticmethod(kernel))
    return calls


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def packed_batch():
    from fusetune.worker.train.data import TokenizedSequence, collate

    torch.manual_seed(1)

    def example(n):
        ids = torch.randint(1, 97, (n,)).tolist()
        return ids

    rows = []
    for lengths in ((5, 9, 3), (11, 4)):
        ids = [t for n in lengths for t in example(n)]
        positions = [p for n in lengths for p in range(n)]
        rows.append(TokenizedSequence(input_ids=ids, shifted_labels=ids, position_ids=positions))
    return rows, collate(rows, pad_token_id=0, packed=True)


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def test_packed_rows_attend_within_each_example_as_sdpa_with_the_packed_mask(reference_kernel):
    model = tiny_llama()
    _, packed = packed_batch()
    expected = logits(model, model_inputs(packed))  # sdpa: transformers builds the block-diagonal mask
    handle = apply_fusetune(model, rope=False, rms_norm=False, swiglu=False, geglu=False,
                            fused_linear_cross_entropy=False)  # fmt: skip
    assert model.config._attn_implementation == VARLEN_ATTENTION
    got = logits(model, model_inputs(packed))
    assert len(reference_kernel) == model.config.num_hidden_layers  # every layer took the varlen path
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Ignoring the boundaries (one sequence per row) changes the result: the comparison can fail.
    wrong = {
        **model_inputs(packed),
        **packed_sequence_kwargs(torch.arange(packed["input_ids"].shape[1]).expand(2, -1)),
    }
    assert (logits(model, wrong) - expected).abs().max() > 1e-2
    handle.revert()
    assert model.config._attn_implementation == "sdpa"


def test_padded_rows_equal_sdpa_with_the_padding_mask_on_real_tokens(reference_kernel):
    from fusetune.worker.train.data import TokenizedSequence, collate

    model = tiny_llama()
    torch.manual_seed(2)
    rows = [
        TokenizedSequence(input_ids=ids, shifted_labels=ids, position_ids=list(range(len(ids))))
        for ids in (torch.randint(1, 97, (n,)).tolist() for n in (13, 4, 9))
    ]
    padded = collate(rows, pad_token_id=0, packed=False)
    assert padded["cu_seq_lens_q"].tolist() == [0, 13, 17, 26, 35, 39]  # rows of 13, 4 + 9 padding, 9 + 4
    expected = logits(model, model_inputs(padded))
    apply_fusetune(
        model, rope=False, rms_norm=False, swiglu=False, geglu=False, fused_linear_cross_entropy=False
    )
    got = logits(model, model_inputs(padded))
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        torch.testing.assert_close(got[i, :n], expected[i, :n], atol=1e-5, rtol=1e-5)
    revert_fusetune(model)


def test_without_boundaries_the_model_runs_sdpa_unchanged():
    model = tiny_llama()
    _, packed = packed_batch()
    inputs = {k: packed[k] for k in ("input_ids", "position_ids")}
    expected = logits(model, inputs)
    apply_fusetune(
        model, rope=False, rms_norm=False, swiglu=False, geglu=False, fused_linear_cross_entropy=False
    )
    assert model.config._attn_implementation == VARLEN_ATTENTION
    torch.testing.assert_close(logits(model, inputs), expected, atol=0, rtol=0)
    torch.testing.assert_close(logits(model, model_inputs(packed)), expected, atol=0, rtol=0)  # a CPU: sdpa
    revert_fusetune(model)


@pytest.mark.parametrize("mask_kind", ["boolean", "additive", "none"])
def test_grouped_decode_equals_transformers_sdpa_over_a_padded_cache(mask_kind):
    """One decoding step over a cache of 20 with left padding (row 1's first 5 slots masked): the grouped
    query rows give transformers' own sdpa result, whose K and V are widened to every head."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 8, 1, 16, generator=generator)
    key, value = (torch.randn(3, 2, 20, 16, generator=generator) for _ in range(2))
    allowed = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    allowed[1, :, :, :5] = False
    allowed[2, :, :, 12:] = False  # a static cache's slots not yet written
    mask = {"boolean": allowed, "additive": torch.zeros(allowed.shape).masked_fill(~allowed, -1e9),
            "none": None}[mask_kind]  # fmt: skip
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = 4, True
    assert attention_module.grouped_decode_applies(module, query, key, 0.0, mask, {})
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    actual, _ = attention_module.grouped_query_decode(query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    # Pairing query heads with KV heads any other way (here interleaved) is caught.
    shuffled = query.view(3, 4, 2, 1, 16).transpose(1, 2).reshape(3, 8, 1, 16)
    wrong, _ = attention_module.grouped_query_decode(shuffled, key, value, mask, scaling=0.3)
    wrong = wrong.view(3, 1, 2, 4, 16).transpose(2, 3).reshape(3, 1, 8, 16)
    assert not torch.allclose(wrong, expected, atol=1e-3)


def test_training_and_full_attention_calls_do_not_take_the_decode_path():
    module = torch.nn.Module().train()
    query, key = torch.zeros(1, 8, 1, 4), torch.zeros(1, 2, 6, 4)
    assert not attention_module.grouped_decode_applies(module, query, key, 0.0, None, {})
    module.eval()
    assert not attention_module.grouped_decode_applies(module, torch.zeros(1, 8, 6, 4), key, 0.0, None, {})
    assert not attention_module.grouped_decode_applies(module, query, torch.zeros(1, 8, 6, 4), 0.0, None, {})
    assert not attention_module.grouped_decode_applies(module, query, key, 0.0, None, {"softcap": 50.0})


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_patched_model_samples_what_transformers_samples(cache):
    """Greedy decoding of left-padded prompts, 12 new tokens, by the attention switched to fusetune's (its
    decoding steps through grouped_query_decode) and by transformers' sdpa: the same tokens, and the last
    step's scores within float32 rounding."""
    from transformers import GenerationConfig

    model = tiny_llama()
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 97, (2, 7), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    config = GenerationConfig(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True,
                              cache_implementation=None if cache == "dynamic" else "static")  # fmt: skip

    def sample():
        with torch.no_grad():
            return model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config
            )

    expected = sample()
    calls = []
    real = attention_module.grouped_query_decode
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_module, "grouped_query_decode", lambda *a: calls.append(1) or real(*a))
        apply_fusetune(model, rope=False, rms_norm=False, swiglu=False, geglu=False,
                       fused_linear_cross_entropy=False)  # fmt: skip
        try:
            actual = sample()
        finally:
            revert_fusetune(model)
    assert len(calls) == 11 * 2  # every step after the prompt's, in both layers
    assert torch.equal(actual.sequences, expected.sequences)
    torch.testing.assert_close(actual.scores[-1], expected.scores[-1], atol=1e-5, rtol=1e-5)


def test_a_model_on_another_attention_is_left_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, attn_implementation="eager")  # fmt: skip
    model = LlamaForCausalLM(config)
    handle = apply_fusetune(model, rope=False, rms_norm=False, swiglu=False, geglu=False,
                            fused_linear_cross_entropy=False)  # fmt: skip
    assert model.config._attn_implementation == "eager"
    assert not handle.active


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 64), (12, 2, 128), (4, 4, 80)])
def test_the_flash_kernel_matches_per_sequence_attention_forward_and_backward(heads, kv_heads, dim):
    from fusetune.models.attention import _VarlenFlashAttention

    torch.manual_seed(0)
    lengths = [620, 1, 1427, 129, 2048, 7]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    tokens = sum(lengths)
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = _VarlenFlashAttention.apply(q, k, v, cu, max(lengths), dim**-0.5)
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_varlen(q64, k64, v64, cu.cpu(), max(lengths), dim**-0.5)
    ref.backward(grad.double())
    # bf16 inputs: errors of a right kernel stay near bf16's resolution; a kernel that crossed a boundary
    # or dropped the causal mask would be off by O(1).
    for name, got, want in (("out", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad),
                            ("dv", v.grad, v64.grad)):  # fmt: skip
        error = (got.double() - want).abs().max().item()
        scale = want.abs().max().item()
        assert error <= 2e-2 * scale, f"{name}: max error {error} vs max {scale}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (12, 2, 128), (4, 4, 80)])
def test_whole_rows_run_sdpa_and_match_per_row_attention(heads, kv_heads, dim, monkeypatch):
    """Rows that are each one sequence go to torch's sdpa (WHOLE_ROWS_TO_SDPA), with the varlen kernel's result:
    causal within each row, grouped-query heads, [batch, seq, heads, dim] out."""
    from fusetune.models.attention import packed_sequence_kwargs, varlen_attention_forward

    calls = []
    monkeypatch.setattr(attention_module._VarlenFlashAttention, "apply", lambda *a: calls.append(a))
    torch.manual_seed(0)
    batch, seq = 2, 1000
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kwargs = packed_sequence_kwargs(torch.arange(seq).expand(batch, -1))
    module = torch.nn.Module()
    out, _ = varlen_attention_forward(module, q, k, v, None, scaling=dim**-0.5, **kwargs)
    assert not calls and out.shape == (batch, seq, heads, dim)
    grad = torch.randn_like(out)
    out.backward(grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    packed = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (q64, k64, v64)]
    ref = reference_varlen(*packed, kwargs["cu_seq_lens_q"], seq, dim**-0.5).view(batch, seq, heads, dim)
    ref.backward(grad.double())
    for name, got, want in (("out", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad),
                            ("dv", v.grad, v64.grad)):  # fmt: skip
        error = (got.double() - want).abs().max().item()
        scale = want.abs().max().item()
        assert error <= 2e-2 * scale, f"{name}: max error {error} vs max {scale}"


def test_bfloat16_sampling_over_a_static_cache_runs_the_decoding_kernel(monkeypatch, device):
    """A bfloat16 model sampling over a static cache (the method's setup on a GPU; here the kernel runs under
    the interpreter): every decoding step of every layer goes through fusetune.kernels.decode_attention, and
    the scores of the first decoding step equal those of the same patched model with the kernel switched off
    (scaled_dot_product_attention over the grouped rows) within bfloat16 rounding."""
    from transformers import GenerationConfig

    model = tiny_llama().to(device=device, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, 97, (2, 7), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    config = GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True,
                              cache_implementation="static", disable_compile=True)  # fmt: skip
    calls = []
    real = attention_module.grouped_decode_attention
    monkeypatch.setattr(attention_module, "grouped_decode_attention", lambda *a: calls.append(1) or real(*a))
    apply_fusetune(model, rope=False, rms_norm=False, swiglu=False, geglu=False,
                   fused_linear_cross_entropy=False)  # fmt: skip
    try:
        with torch.no_grad():
            kernel = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config
            )
            monkeypatch.setattr(attention_module, "DECODE_KERNEL", False)
            n_calls = len(calls)
            sdpa = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config
            )
    finally:
        revert_fusetune(model)
    assert n_calls == 3 * 2 and len(calls) == n_calls  # three decoding steps, two layers; none with it off
    torch.testing.assert_close(kernel.scores[1].float(), sdpa.scores[1].float(), atol=3e-2, rtol=2e-2)
    assert not torch.allclose(kernel.scores[1].float(), kernel.scores[0].float(), atol=3e-2)
