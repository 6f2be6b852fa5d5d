"""The job estimate's memory model responds to each setting the way the trainer's memory does."""

import dataclasses

from fusetune.spec.estimate import (
    OFFLOAD_PREFETCH_LAYERS,
    DataCounts,
    ModelShape,
    checkpoint_bytes,
    estimate_job,
    job_plan,
    lora_parameter_count,
)
from fusetune.spec.hyperparameters import JobHyperparameters
from fusetune.spec.job import JobSpec

LLAMA_1B = ModelShape(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                      head_dim=64, vocab_size=128256, tied_embeddings=True)  # fmt: skip


DATA = DataCounts(example_count=64, token_estimate=64 * 2048)


def _job(**hyperparameters) -> JobSpec:
    chosen = {
        "n_epochs": 1,
        "batch_size": 8,
        "max_seq_length": 2048,
        "precision": "bf16-mixed",
        **hyperparameters,
    }
    return JobSpec(hyperparameters=JobHyperparameters(**chosen))


def _estimate(micro_batch_size=None, **hyperparameters):
    return estimate_job(LLAMA_1B, _job(**hyperparameters), DATA, micro_batch_size=micro_batch_size)


def test_lora_parameter_count_matches_peft_arithmetic():
    # q (2048->2048), k and v (2048->512), o (2048->2048), gate and up (2048->8192), down (8192->2048), r=16
    per_layer = 16 * ((2048 + 2048) * 2 + (2048 + 512) * 2 + (2048 + 8192) * 3)
    assert lora_parameter_count(LLAMA_1B, 16, "all-linear") == 16 * per_layer
    assert lora_parameter_count(LLAMA_1B, 8, ["q_proj", "v_proj"]) == 16 * 8 * ((2048 + 2048) + (2048 + 512))


def test_each_setting_moves_the_terms_it_should():
    full = _estimate()
    assert full.parameters == LLAMA_1B.parameter_count()
    breakdown = full.memory_breakdown
    assert breakdown["weights_grads_optimizer"] == 18 * full.parameters
    # 8 x 2048 tokens, 16 layers, 83968 bytes saved per token and layer with the fused kernels
    assert breakdown["activations"] == 8 * 2048 * 16 * (12 * 2048 + 4 * 2048 + 4 * 512 + 6 * 8192)

    lora = _estimate(lora={"r": 16, "target_modules": "all-linear"}).memory_breakdown
    assert lora["weights_grads_optimizer"] < breakdown["weights_grads_optimizer"] / 2
    assert lora["activations"] == breakdown["activations"]

    checkpointed = _estimate(gradient_checkpointing=True).memory_breakdown
    assert checkpointed["activations"] < breakdown["activations"] / 4
    assert checkpointed["weights_grads_optimizer"] == 16 * full.parameters  # no bf16 copies kept

    unfused = _estimate(kernels=False).memory_breakdown
    assert unfused["activations"] > breakdown["activations"] and unfused["logits"] > 20 * breakdown["logits"]

    sharded = _estimate(n_gpus=4, batch_size=32, distributed="fsdp").memory_breakdown
    assert sharded["weights_grads_optimizer"] < breakdown["weights_grads_optimizer"] / 3
    replicated = _estimate(n_gpus=4, batch_size=32, distributed="ddp").memory_breakdown
    assert replicated["weights_grads_optimizer"] == breakdown["weights_grads_optimizer"]
    assert replicated["activations"] == breakdown["activations"]  # 8 sequences per GPU either way


def test_micro_batch_follows_the_trainer_default():
    # 32 sequences of 2048 on one GPU: micro-batches of 8 (16384 tokens), so the activations of 8, not 32
    assert (
        _estimate(batch_size=32).memory_breakdown["activations"]
        == _estimate().memory_breakdown["activations"]
    )


def test_fused_loss_chunk_follows_the_kernel_default():
    """The estimate's torch-free copy of the chunk rule agrees with the kernel's own choice."""
    import pytest

    torch = pytest.importorskip("torch")
    from fusetune.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy_chunk_rows
    from fusetune.spec.estimate import fused_loss_chunk_rows

    for tokens, hidden, vocab in [(16384, 2048, 128256), (8192, 4096, 128256), (1024, 4096, 128256),
                                  (8192, 1536, 151936), (65536, 4096, 32000), (4096, 2304, 256000)]:  # fmt: skip
        shape = ModelShape(hidden_size=hidden, intermediate_size=4 * hidden, num_layers=1, num_heads=8,
                           num_kv_heads=8, head_dim=hidden // 8, vocab_size=vocab, tied_embeddings=True)  # fmt: skip
        chosen = fused_linear_cross_entropy_chunk_rows(tokens, hidden, vocab, torch.bfloat16)
        most = fused_loss_chunk_rows(tokens, shape)
        assert chosen <= most and (chosen > 0.8 * most or chosen == tokens), (tokens, hidden, vocab)


def test_the_precision_mode_sets_the_bytes_per_parameter():
    params = LLAMA_1B.parameter_count()
    states = {
        p: _estimate(precision=p).memory_breakdown["weights_grads_optimizer"] for p in ("auto", "bf16-sr")
    }
    # auto on a GPU is bf16-sr: weight 2 + gradient 2 + two bf16 AdamW moments 4, no copy.
    assert states["auto"] == states["bf16-sr"] == 8 * params
    # bf16-mixed: fp32 weight 4 + gradient 4 + moments 8, and the bf16 copy autocast keeps (2).
    assert _estimate(precision="bf16-mixed").memory_breakdown["weights_grads_optimizer"] == 18 * params
    assert _estimate(precision="fp32").memory_breakdown["weights_grads_optimizer"] == 16 * params
    assert _estimate(precision="bf16").memory_breakdown["weights_grads_optimizer"] == 8 * params
    # bf16-sr-8bit: weight 2 + gradient 2 + two 1-byte moment codes with one fp32 scale per 256 elements each.
    eight_bit = _estimate(precision="bf16-sr-8bit").memory_breakdown["weights_grads_optimizer"]
    assert eight_bit == int(params * (4 + 2 * (1 + 4 / 256)))


def test_bf16_weights_with_the_fused_mlp_keep_fewer_activations():
    """With bf16 weights the patched MLP keeps neither its norm's output nor the product (and the residual is
    bf16), so a step saves 51200 rather than 83968 bytes per token and layer at the Llama-3.2-1B shape."""
    mixed = _estimate(precision="bf16-mixed").memory_breakdown["activations"]
    pure = _estimate(precision="bf16-sr").memory_breakdown["activations"]
    assert pure == 8 * 2048 * 16 * (4 * 2048 + 4 * 2048 + 4 * 512 + 4 * 8192)
    assert pure < 0.65 * mixed
    assert _estimate(precision="bf16-sr", kernels=False).memory_breakdown["activations"] > mixed


def _with(**plan_changes):
    """The same job's estimate under its plan with `plan_changes`."""
    job = _job(precision="bf16-sr")
    plan = dataclasses.replace(job_plan(LLAMA_1B, job), **plan_changes)
    return estimate_job(LLAMA_1B, job, DATA, plan=plan).memory_breakdown


def test_each_recomputed_layer_keeps_only_its_input():
    """k of 16 layers recomputed: 16 - k layers' saved tensors, k bf16 inputs, and one layer rebuilt at a time
    in the backward; k = 16 is gradient_checkpointing, k = 0 none."""
    tokens, per_layer, layer_input = 8 * 2048, 4 * 2048 + 4 * 2048 + 4 * 512 + 4 * 8192, 2 * 2048
    none = _with(recompute_layers=0)["activations"]
    assert none == tokens * 16 * per_layer
    for k in (1, 5, 16):
        assert _with(recompute_layers=k)["activations"] == tokens * (
            (16 - k) * per_layer + k * layer_input + per_layer
        )
    assert (
        _with(recompute_layers=16)["activations"]
        == (_estimate(precision="bf16-sr", gradient_checkpointing=True).memory_breakdown["activations"])
    )
    # A mixed mode's compute-dtype weight copies go with the layers that keep their activations.
    mixed = _job(precision="bf16-mixed")
    states = [
        estimate_job(
            LLAMA_1B, mixed, DATA, plan=dataclasses.replace(job_plan(LLAMA_1B, mixed), recompute_layers=k)
        ).memory_breakdown["weights_grads_optimizer"]
        for k in (0, 8, 16)
    ]
    assert states[0] - states[1] == states[1] - states[2] == LLAMA_1B.parameter_count()  # 2 bytes x half


def test_offloaded_layers_leave_the_gpu_but_a_prefetch_window():
    job = _job(precision="bf16-sr")
    tokens, per_layer = 8 * 2048, 4 * 2048 + 4 * 2048 + 4 * 512 + 4 * 8192
    for o in (0, 1, OFFLOAD_PREFETCH_LAYERS, 10, 16):
        plan = dataclasses.replace(job_plan(LLAMA_1B, job), offload_layers=o)
        estimate = estimate_job(LLAMA_1B, job, DATA, plan=plan)
        on_gpu = 16 - o + min(o, OFFLOAD_PREFETCH_LAYERS)
        assert estimate.memory_breakdown["activations"] == tokens * on_gpu * per_layer
        assert estimate.host_activation_bytes == tokens * o * per_layer


def test_optimizer_in_backward_keeps_only_the_gradients_in_flight():
    """The gradients that exist at once: the embedding's (tied to the output layer, it accumulates through the
    whole backward) and two layers' (one completed, one stepped), in bf16."""
    after = _with(optimizer_in_backward=False)["weights_grads_optimizer"]
    inside = _with(optimizer_in_backward=True)["weights_grads_optimizer"]
    params = LLAMA_1B.parameter_count()
    in_flight = params - 16 * LLAMA_1B.layer_parameter_count() + 2 * LLAMA_1B.layer_parameter_count()
    assert after - inside == 2 * (params - in_flight)
    # LoRA: two layers' adapters.
    lora = _job(precision="bf16-sr", lora={"r": 16, "target_modules": "all-linear"})
    plans = [dataclasses.replace(job_plan(LLAMA_1B, lora), optimizer_in_backward=b) for b in (False, True)]
    lora_states = [estimate_job(LLAMA_1B, lora, DATA, plan=plan).memory_breakdown for plan in plans]
    adapters = lora_parameter_count(LLAMA_1B, 16, "all-linear")
    saved = lora_states[0]["weights_grads_optimizer"] - lora_states[1]["weights_grads_optimizer"]
    assert saved == 2 * (adapters - 2 * adapters // 16)


def test_a_checkpoint_holds_the_weights_and_the_optimizer_state():
    params = LLAMA_1B.parameter_count()
    job = _job()
    assert checkpoint_bytes(LLAMA_1B, job, "bf16-sr") == params * (2 + 4)
    assert checkpoint_bytes(LLAMA_1B, job, "bf16-sr-8bit") == int(params * (2 + 2 * (1 + 4 / 256)))
    assert checkpoint_bytes(LLAMA_1B, job, "bf16-mixed") == params * (4 + 8)
    adapters = lora_parameter_count(LLAMA_1B, 16, "all-linear")
    lora = _job(lora={"r": 16, "target_modules": "all-linear"})
    assert checkpoint_bytes(LLAMA_1B, lora, "bf16-sr") == adapters * 6
    merged = _job(lora={"r": 16, "target_modules": "all-linear"}, merge_lora_on_save=True)
    assert checkpoint_bytes(LLAMA_1B, merged, "bf16-sr") == adapters * 6 + params * 2
