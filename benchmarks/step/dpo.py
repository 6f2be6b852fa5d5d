"""A DPO training step measured three ways on the same data and weights: fusetune's DPO method through its
real `Trainer`, TRL's `DPOTrainer` with its defaults, and TRL with Liger-Kernel's fused DPO loss.

Setup, made once by the parent process: a model of a public architecture's shape (random weights, seed 0,
bf16, the demo tokenizer; `benchmarks/workloads.py`'s `build_model`) saved as the *reference*, and a *policy*
that is the reference plus Gaussian noise of `--perturbation` times each weight tensor's standard deviation
(seed 1), saved beside it; and a preference file in the OpenAI DPO format whose pairs share a prompt and
differ in their answers, each side (prompt + answer through the chat template) `--seq` tokens or a little
fewer with the demo tokenizer, so nothing is truncated. Each implementation then runs in a fresh process:

    fusetune    the service's path: `Trainer` built in process as a DPO job (batch `--pairs`, max_seq_length
                `--seq`, no packing, the GPU default precision bf16-sr with its fused AdamW, fusetune's kernels
                and its per-sequence log-probabilities without logits). The Trainer is built on the reference
                weights and runs its own reference pass (`before_training`, timed apart as
                `reference_pass_s`: a job pays it once, before its first step); then the policy's weights are
                copied into the same parameters. No second model is held during the steps.
    trl         `trl.DPOTrainer` with its defaults (a second copy of the model as the reference, full logits,
                gradient checkpointing on, its default optimizer and bf16 autocast) on the policy and
                reference loaded in bf16; batch `--pairs`, `max_length` `--seq`.
    fusetune+gc the same with gradient checkpointing on, as TRL's default has it: the like-for-like memory
                comparison with the TRL rows.
    trl+liger   the same, with Liger-Kernel's fused linear DPO loss (`LigerFusedLinearDPOLoss`). TRL turns it on
                with `use_liger_kernel=True` in `DPOConfig` (the `use_liger_loss` of older releases, taken when
                the installed `DPOConfig` has it); TRL releases after 1.12 dropped it, and the row then says so.

Per implementation: the median step time over `--steps` steps after `--warmup-steps` (from the batch on the
device to the optimizer's update done, `torch.cuda.synchronize()` on both ends; TRL's steps are timed by a
callback at `on_step_begin` / `on_step_end`, which bracket the same span in `transformers.Trainer`), and the
peak allocated memory, `torch.cuda.max_memory_allocated()` from a reset just before each step to its end: all
tensors alive in the process during the step (weights of the policy and of a reference model if one is held,
gradients, optimizer state, activations, logits, the loss's workspace), the median over the timed steps.

Why the policy is perturbed: at the first step of a real run the policy is its reference, so every
implementation reports loss ln 2 and zero rewards whatever it computes. Here the policy differs from the
reference, so the first step's loss, rewards and reward accuracy depend on every log-probability each
implementation computes, for the policy and for the reference. Each implementation computes them with its own
training loss code, in its own precision, on the first `--pairs` pairs of the file, before any update (the
pairs of a step are drawn in a different order by each trainer, so "the first step" is these pairs). A fourth
process, `exact`, computes the same quantities in float32 weights with float64 log-softmax from the logits, on
fusetune's tokenization; each row's `first_pairs` carries its differences from it, and the number of scored
tokens each implementation saw per side, so a difference of tokenization shows as such.

    python3 -m benchmarks.step.dpo
    python3 -m benchmarks.step.dpo --impls fusetune,trl+liger --steps 5
    TRITON_INTERPRET=1 python3 -m benchmarks.step.dpo --tiny     # CPU smoke run, numbers mean nothing

TRL (with `datasets`) is imported only by its rows: without it they are recorded as skipped. Results go to the
section "dpo" of `benchmarks/results/<gpu-slug>-step.json` (the format of shared/ANCHORS.md; `impl` is
fusetune / trl / trl+liger).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import GIB, markdown_table, short_error
from benchmarks.step.trainer_step import build_trainer, job_batches
from benchmarks.workloads import build_model

RESULTS = harness.Benchmark("dpo", topic="step")
IMPLS = ("fusetune", "fusetune+gc", "trl", "trl+liger")
FIRST_PAIR_METRICS = (
    "loss",
    "chosen_reward",
    "rejected_reward",
    "reward_accuracy",
    "chosen_logp",
    "rejected_logp",
)
# What "equal within tolerance" means here: rewards and loss within this much of the float64 values, the mean
# summed log-probabilities within this fraction of their size. Rewards are beta times differences of sums over
# ~1000 tokens, so a small per-token bias of a bf16 forward adds up in each side's reward; it cancels in the
# margin (`reward_margin` in the differences), which is what the loss sees.
DEFAULT_REWARD_ATOL = 0.1
DEFAULT_LOGP_RTOL = 2e-3


# ------------------------------------------------------------------------------------------- inputs


def preference_examples(
    n_pairs: int, seq: int, tokenizer, seed: int = 0
) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """`n_pairs` lines of the OpenAI DPO format, each side (prompt + answer, templated) at most `seq` tokens and
    within 64 of it, with their templated (chosen, rejected) lengths. Text is digit groups and words the demo
    tokenizer knows; the two answers of a pair are drawn independently."""
    rng = random.Random(seed)
    words = ["What", "is", "the", "sum", "answer", "plus", "minus", "of", "and", "Reply"]

    def pieces(n: int) -> list[str]:
        return [rng.choice(words) if rng.random() < 0.5 else str(rng.randrange(10, 10_000)) for _ in range(n)]

    def side_length(messages: list[dict[str, Any]]) -> int:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])

    examples, lengths = [], []
    for _ in range(n_pairs):
        prompt = [
            {"role": "system", "content": "You are a precise assistant."},
            {"role": "user", "content": " ".join(pieces(max(2, seq // 2 // 4)))},
        ]
        answers = []
        for _side in range(2):
            # About 3.5 tokens per piece; grow the answer until the side is within 64 tokens of `seq`.
            words_of_answer = pieces(max(2, seq // 2 // 4))
            while True:
                messages = [*prompt, {"role": "assistant", "content": " ".join(words_of_answer)}]
                length = side_length(messages)
                if length > seq and len(words_of_answer) == 1:
                    raise ValueError(f"the prompt alone fills {length} tokens of the {seq} of a side")
                if length > seq:
                    words_of_answer = words_of_answer[
                        : max(1, len(words_of_answer) - 1 - (length - seq) // 3)
                    ]
                elif length < seq - 64 and len(words_of_answer) < 4 * seq:
                    words_of_answer += pieces(max(1, (seq - length) // 5))
                else:
                    break
            answers.append((" ".join(words_of_answer), length))
        (chosen, chosen_length), (rejected, rejected_length) = answers
        if chosen == rejected:
            rejected += " 0"
        examples.append(
            {
                "input": {"messages": prompt},
                "preferred_output": [{"role": "assistant", "content": chosen}],
                "non_preferred_output": [{"role": "assistant", "content": rejected}],
            }
        )
        lengths.append((chosen_length, rejected_length))
    return examples, lengths


def build_policy(reference_path: Path, policy_path: Path, perturbation: float, seed: int = 1) -> Path:
    """The reference plus noise: each floating-point tensor gets `perturbation` times its standard deviation of
    Gaussian noise (a constant tensor, such as a norm's ones, gets `perturbation` times its mean magnitude)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            values = parameter.float()
            scale = values.std().item() if values.numel() > 1 else 0.0
            scale = scale if scale > 0 else values.abs().mean().item()
            noise = torch.randn(values.shape, generator=generator) * (perturbation * scale)
            parameter.copy_((values + noise).to(parameter.dtype))
    model.save_pretrained(policy_path)
    AutoTokenizer.from_pretrained(reference_path).save_pretrained(policy_path)
    return policy_path


def prepare_inputs(args, folder: Path) -> dict[str, Any]:
    from fusetune.demo.assets import build_tokenizer

    reference_path = build_model(folder / "reference", args.model, tiny=args.tiny)
    policy_path = build_policy(reference_path, folder / "policy" / args.model, args.perturbation)
    n_pairs = args.pairs * (args.warmup_steps + args.steps + 1)
    examples, lengths = preference_examples(n_pairs, args.seq, build_tokenizer())
    training_file = folder / "preferences.jsonl"
    training_file.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return {
        "reference_path": str(reference_path),
        "policy_path": str(policy_path),
        "training_file": str(training_file),
        "data": {
            "pairs": n_pairs,
            "side_tokens_min": min(min(pair) for pair in lengths),
            "side_tokens_max": max(max(pair) for pair in lengths),
            "tokens": sum(sum(pair) for pair in lengths),
        },
    }


# ------------------------------------------------------------------------------------------- one implementation


class _Timer:
    """Step times and per-step allocated peaks, bracketed by device synchronisations."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.started = 0.0

    def begin(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.started = time.perf_counter()

    def end(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.started)
        self.peaks.append(torch.cuda.max_memory_allocated() if self.cuda else 0)

    def summary(self, warmup_steps: int) -> dict[str, Any]:
        times, peaks = self.times[warmup_steps:], self.peaks[warmup_steps:]
        if not times:
            raise RuntimeError(f"no timed step: {len(self.times)} steps ran, {warmup_steps} of them warm-up")
        return {
            "step_ms": round(statistics.median(times) * 1e3, 2),
            "step_ms_min": round(min(times) * 1e3, 2),
            "steps_timed": len(times),
            "peak_alloc_gb": round(statistics.median(peaks) / GIB, 3) if self.cuda else None,
            "peak_alloc_bytes": int(statistics.median(peaks)) if self.cuda else None,
        }


def _copy_weights_in_place(model, path: str) -> None:
    """Every parameter of `model` from the safetensors files of `path`, copied into the existing tensors (the
    optimizer and the patched modules keep pointing at them)."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    missing = [name for name, _ in model.named_parameters() if name not in state]
    if missing:
        raise RuntimeError(f"{path} lacks parameters {missing[:5]} ({len(missing)} in all)")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(state[name].to(parameter.dtype))


def run_fusetune(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from fusetune.spec.methods import method_spec
    from fusetune.worker.train.data import IGNORE_INDEX
    from fusetune.worker.train.trainer import Trainer

    cuda = spec["device"] == "cuda"

    class SmokeTrainer(Trainer):
        def _apply_kernels(self) -> bool:
            # The service patches only on a GPU; a CPU smoke run under TRITON_INTERPRET=1 runs the same kernels.
            if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
                from fusetune.models import apply_fusetune

                return apply_fusetune(self.model, strict=False).active
            return super()._apply_kernels()

    trainer = build_trainer(
        {**spec, "model_path": spec["reference_path"], "batch": spec["pairs"]},
        SmokeTrainer,
        packing=False,
        method=method_spec("dpo", beta=spec["beta"]),
        gradient_checkpointing=bool(spec.get("gradient_checkpointing")),
    )
    device = trainer.device
    method = trainer.method
    started = time.perf_counter()
    method.before_training(trainer)  # the reference pass, on the reference's weights
    reference_pass_s = time.perf_counter() - started
    _copy_weights_in_place(trainer.model, spec["policy_path"])

    # The first pairs of the file through the method's own loss, before any update.
    rows = trainer.train_data.sequences[: spec["pairs"]]
    normaliser = torch.tensor(len(rows), device=device)
    sums: dict[str, float] = {}
    policy_logps, scored_tokens = [], []
    with torch.no_grad():
        for start in range(0, len(rows), trainer.micro_batch_size):
            batch = trainer._batch(rows[start : start + trainer.micro_batch_size], packed=False)
            with trainer._autocast():
                loss, metrics = method.loss(trainer.train_model, batch, normaliser)
                policy_logps.append(method.sequence_log_probs(trainer.train_model, batch).float().view(2, -1))
            for name, value in {"loss": loss, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + float(value)
            scored_tokens.append((batch["shifted_labels"] != IGNORE_INDEX).sum(-1).view(2, -1))
    logps = torch.cat(policy_logps, dim=1)
    tokens = torch.cat(scored_tokens, dim=1)
    first_pairs = {
        "loss": sums["loss"],
        "chosen_reward": sums["chosen_reward"],
        "rejected_reward": sums["rejected_reward"],
        "reward_accuracy": sums["reward_accuracy"],
        "chosen_logp": float(logps[0].mean()),
        "rejected_logp": float(logps[1].mean()),
        "scored_tokens": {"chosen": tokens[0].tolist(), "rejected": tokens[1].tolist()},
    }

    batches = job_batches(trainer, spec["warmup_steps"] + spec["steps"])
    timer = _Timer(cuda)
    for micro_batches in batches:
        timer.begin()
        trainer.train_step(micro_batches)
        timer.end()
    return {
        **timer.summary(spec["warmup_steps"]),
        "reference_pass_s": round(reference_pass_s, 3),
        "micro_batch_size": trainer.micro_batch_size,
        "micro_batches_per_step": trainer.grad_accum_steps,
        "precision": trainer.precision.mode.name,
        "optimizer": trainer.optimizer_name,
        "kernels_applied": trainer.kernels_applied,
        "reference_model_held": False,
        "gradient_checkpointing": bool(trainer.config.gradient_checkpointing),
        "first_pairs": first_pairs,
    }


def run_trl(spec: dict[str, Any], liger: bool) -> dict[str, Any]:
    import dataclasses

    import torch

    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import DPOConfig, DPOTrainer
    except ImportError as error:
        return {"error": f"skipped: trl not installed ({short_error(error, 120)})", "skipped": True}
    config_fields = {field.name for field in dataclasses.fields(DPOConfig)}
    liger_options: dict[str, Any] = {}
    if liger:
        import trl.trainer.dpo_trainer as dpo_module

        if (
            harness.package_version("liger-kernel") is None
            and harness.package_version("liger_kernel") is None
        ):
            return {"error": "skipped: liger-kernel not installed", "skipped": True}
        if "use_liger_loss" in config_fields:
            liger_options["use_liger_loss"] = True
        elif hasattr(dpo_module, "LigerFusedLinearDPOLoss"):
            liger_options["use_liger_kernel"] = True
        else:
            return {
                "error": f"skipped: TRL {harness.package_version('trl')} has no Liger DPO loss (TRL <= 1.12 has it)",
                "skipped": True,
            }
        if spec["device"] == "cpu":
            # `use_liger_kernel` also patches the model's layers with Liger's Triton kernels, which do not run under
            # TRITON_INTERPRET; the CPU smoke run keeps only the fused DPO loss (plain PyTorch).
            off = ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy")
            liger_options["liger_kernel_config"] = dict.fromkeys(off, False)

    cuda = spec["device"] == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(spec["policy_path"])
    # As TRL builds its own reference by default (same dtype and attention as the policy), loaded here from the
    # reference's folder instead of the policy's.
    model = AutoModelForCausalLM.from_pretrained(spec["policy_path"], dtype=dtype, attn_implementation="sdpa")
    reference = AutoModelForCausalLM.from_pretrained(
        spec["reference_path"], dtype=dtype, attn_implementation="sdpa"
    )
    lines = [
        json.loads(line) for line in Path(spec["training_file"]).read_text().splitlines() if line.strip()
    ]
    dataset = Dataset.from_list(
        [
            {
                "prompt": line["input"]["messages"],
                "chosen": line["preferred_output"],
                "rejected": line["non_preferred_output"],
            }
            for line in lines
        ]
    )
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(prefix="fusetune-dpo-bench-trl-"),
        per_device_train_batch_size=spec["pairs"],
        gradient_accumulation_steps=1,
        max_steps=spec["warmup_steps"] + spec["steps"],
        max_length=spec["seq"],
        beta=spec["beta"],
        seed=0,
        bf16=cuda,
        use_cpu=not cuda,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        **liger_options,
    )
    timer = _Timer(cuda)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            timer.begin()

        def on_step_end(self, *_args, **_kwargs):
            timer.end()

    trainer = DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )

    # The first pairs of the file through TRL's own loss, before any update.
    examples = [trainer.train_dataset[i] for i in range(spec["pairs"])]
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    trainer.model.train()
    trainer._metrics["train"].clear()
    with torch.no_grad(), trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, batch)
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
    trainer._metrics["train"].clear()
    mask = batch["completion_mask"][:, 1:]
    tokens = mask.sum(-1).view(2, -1)
    first_pairs = {
        "loss": float(loss),
        "chosen_reward": logged.get("rewards/chosen"),
        "rejected_reward": logged.get("rewards/rejected"),
        "reward_accuracy": logged.get("rewards/accuracies"),
        "chosen_logp": logged.get("logps/chosen"),
        "rejected_logp": logged.get("logps/rejected"),
        "scored_tokens": {"chosen": tokens[0].tolist(), "rejected": tokens[1].tolist()},
    }

    trainer.train()
    optimizer = type(
        trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    )
    return {
        **timer.summary(spec["warmup_steps"]),
        "micro_batch_size": spec["pairs"],
        "micro_batches_per_step": 1,
        "precision": "bf16 weights, bf16 autocast" if cuda else "fp32",
        "optimizer": f"{getattr(args.optim, 'value', args.optim)} ({optimizer.__name__})",
        "reference_model_held": True,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "liger_options": liger_options or None,
        "trl": harness.package_version("trl"),
        "datasets": harness.package_version("datasets"),
        "first_pairs": first_pairs,
    }


def run_exact(spec: dict[str, Any]) -> dict[str, Any]:
    """The first pairs' loss, rewards and accuracy from float32 weights and float64 log-softmax, one sequence at
    a time, on fusetune's tokenization of the file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fusetune.spec.methods import method_spec
    from fusetune.worker.train.config import TrainConfig
    from fusetune.worker.train.methods.dpo import DirectPreferenceOptimization

    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(spec["reference_path"])
    config = TrainConfig(
        model_path=spec["reference_path"], training_file=spec["training_file"], output_dir=tempfile.mkdtemp(),
        max_seq_length=spec["seq"], method=method_spec("dpo", beta=spec["beta"]),
    )  # fmt: skip
    method = DirectPreferenceOptimization(config, tokenizer, tokenizer.pad_token_id or 0)
    pairs = method.load_data(spec["training_file"], packing=False).sequences[: spec["pairs"]]

    def sequence_logps(path: str) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        model.to(device).eval()
        values = torch.zeros(2, len(pairs), dtype=torch.float64)
        with torch.no_grad():
            for index, pair in enumerate(pairs):
                for side, sequence in enumerate((pair.chosen, pair.rejected)):
                    ids = torch.tensor([sequence.input_ids], device=device)
                    labels = torch.tensor(sequence.shifted_labels, device=device)
                    logits = model(input_ids=ids, use_cache=False).logits[0].double()
                    scored = labels != -100
                    token_logps = logits[scored].log_softmax(-1).gather(-1, labels[scored, None])
                    values[side, index] = token_logps.sum().item()
                    del logits
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return values

    policy, reference = sequence_logps(spec["policy_path"]), sequence_logps(spec["reference_path"])
    beta = spec["beta"]
    rewards = beta * (policy - reference)
    losses = -torch.nn.functional.logsigmoid(rewards[0] - rewards[1])
    return {
        "first_pairs": {
            "loss": float(losses.mean()),
            "chosen_reward": float(rewards[0].mean()),
            "rejected_reward": float(rewards[1].mean()),
            "reward_accuracy": float((rewards[0] > rewards[1]).double().mean()),
            "chosen_logp": float(policy[0].mean()),
            "rejected_logp": float(policy[1].mean()),
            "per_pair_rewards": {"chosen": rewards[0].tolist(), "rejected": rewards[1].tolist()},
            "scored_tokens": {
                "chosen": [p.chosen.n_label_tokens for p in pairs],
                "rejected": [p.rejected.n_label_tokens for p in pairs],
            },
        }
    }


def run_impl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    if spec["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    impl = spec["impl"]
    if impl in ("fusetune", "fusetune+gc"):
        return run_fusetune({**spec, "gradient_checkpointing": impl == "fusetune+gc"})
    if impl in ("trl", "trl+liger"):
        return run_trl(spec, liger=impl == "trl+liger")
    if impl == "exact":
        return run_exact(spec)
    raise ValueError(f"unknown impl {impl!r}")


# ------------------------------------------------------------------------------------------- comparison


def compare_first_pairs(row: dict[str, Any], exact: dict[str, Any], reward_atol: float, logp_rtol: float):
    """Each first-pairs value's difference from the exact one, and whether all are within tolerance: rewards,
    loss and accuracy to `reward_atol` (accuracy exactly, unless a pair's exact margin is within the
    tolerance), mean log-probabilities to `logp_rtol` of their size, scored tokens exactly."""
    mine = row.get("first_pairs")
    if not mine or not exact:
        return None
    differences = {
        name: None if mine.get(name) is None else round(mine[name] - exact[name], 6)
        for name in FIRST_PAIR_METRICS
    }
    if mine.get("chosen_reward") is not None and mine.get("rejected_reward") is not None:
        # The loss sees only the margin: a bias common to both sides' rewards (bf16's, say) cancels in it.
        differences["reward_margin"] = round(
            (mine["chosen_reward"] - mine["rejected_reward"])
            - (exact["chosen_reward"] - exact["rejected_reward"]),
            6,
        )
    margins = [c - r for c, r in zip(*exact["per_pair_rewards"].values(), strict=True)]
    accuracy_tolerance = sum(abs(m) <= reward_atol for m in margins) / max(len(margins), 1)
    within = {
        "loss": abs(differences["loss"]) <= reward_atol,
        "chosen_reward": abs(differences["chosen_reward"]) <= reward_atol,
        "rejected_reward": abs(differences["rejected_reward"]) <= reward_atol,
        "reward_accuracy": abs(differences["reward_accuracy"]) <= accuracy_tolerance + 1e-9,
        "chosen_logp": abs(differences["chosen_logp"]) <= logp_rtol * abs(exact["chosen_logp"]),
        "rejected_logp": abs(differences["rejected_logp"]) <= logp_rtol * abs(exact["rejected_logp"]),
        "scored_tokens": mine.get("scored_tokens") == exact.get("scored_tokens"),
    }
    return {
        "difference_from_exact": differences,
        "within_tolerance": within,
        "agrees": all(within.values()),
    }


def render_markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    exact = payload.get("exact_first_pairs") or {}
    lines = [
        f"# DPO training step — {payload['gpu']}, {payload['date']}",
        "",
        f"`{payload['command']}`; versions: {payload['versions']}",
        "",
        f"Model {payload['model']} (random weights; the policy is the reference perturbed by "
        f"{payload['perturbation']} x each tensor's std), {payload['pairs']} pairs x {payload['seq']} tokens per "
        f"side (data: {payload['data']}), beta {payload['beta']}. Step time: median of {payload['steps']} steps "
        f"after {payload['warmup_steps']} warm-up; peak: max_memory_allocated over a step (weights, reference "
        "model if held, gradients, optimizer state, activations), median over the timed steps.",
        "",
    ]
    header = ["impl", "step ms", "peak GB", "reference held", "grad ckpt", "precision", "optimizer", "error"]
    lines.append(markdown_table(header, [
        [r["impl"], r.get("step_ms"), r.get("peak_alloc_gb"), r.get("reference_model_held"),
         r.get("gradient_checkpointing"), r.get("precision"), r.get("optimizer"), r.get("error") or ""]
        for r in rows
    ]))  # fmt: skip
    goals = payload.get("goals")
    if goals:
        lines += ["", "Goals: " + ", ".join(f"{k}: {v}" for k, v in goals.items())]
    lines += ["", "## First pairs, before any update (each implementation's own loss code)", ""]
    table = [["exact (fp32 weights, fp64 log-softmax)", *(exact.get(m) for m in FIRST_PAIR_METRICS), "", ""]]
    for r in rows:
        first = r.get("first_pairs") or {}
        comparison = r.get("comparison") or {}
        failed = [k for k, ok in (comparison.get("within_tolerance") or {}).items() if not ok]
        table.append(
            [
                r["impl"],
                *(first.get(m) for m in FIRST_PAIR_METRICS),
                comparison.get("agrees"),
                ", ".join(failed),
            ]
        )
    lines.append(markdown_table(["impl", *FIRST_PAIR_METRICS, "agrees", "outside tolerance"], table))
    lines += ["", f"Tolerances: {payload['tolerances']}"]
    return "\n".join(lines) + "\n"


def goals(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The issue's goals for each fusetune row: peak memory <= 0.5 x TRL's and <= Liger's, step time <= Liger's,
    and first-pair values as exact as the baselines': each of loss, both rewards and their margin no further
    from the float64 values than the furthest of TRL's and Liger's (their own bf16 error is the tolerance)."""
    by_impl = {r["impl"]: r for r in rows if r.get("step_ms") is not None}
    trl, liger = by_impl.get("trl"), by_impl.get("trl+liger")
    baselines = [
        r for r in (trl, liger) if r is not None and (r.get("comparison") or {}).get("difference_from_exact")
    ]
    result: dict[str, Any] = {}
    for impl in ("fusetune", "fusetune+gc"):
        ours = by_impl.get(impl)
        if ours is None or ours.get("peak_alloc_gb") is None:
            continue
        if trl is not None:
            result[f"{impl} peak / trl"] = round(ours["peak_alloc_gb"] / trl["peak_alloc_gb"], 3)
        if liger is not None:
            result[f"{impl} peak / liger"] = round(ours["peak_alloc_gb"] / liger["peak_alloc_gb"], 3)
            result[f"{impl} step time / liger"] = round(ours["step_ms"] / liger["step_ms"], 3)
        mine = (ours.get("comparison") or {}).get("difference_from_exact")
        if mine and baselines:
            keys = ("loss", "chosen_reward", "rejected_reward", "reward_margin")
            result[f"{impl} as exact as the baselines"] = all(
                abs(mine[k]) <= max(abs(b["comparison"]["difference_from_exact"][k]) for b in baselines)
                for k in keys
            )
    return result or None


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="llama-3.2-1b-shape", help="a model shape of benchmarks/workloads.py"
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {IMPLS}")
    parser.add_argument("--pairs", type=int, default=4, help="preference pairs per optimizer step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per side of a pair (prompt + answer)")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument(
        "--perturbation",
        type=float,
        default=0.02,
        help="policy = reference + this x each tensor's std of noise",
    )
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reward-atol", type=float, default=DEFAULT_REWARD_ATOL)
    parser.add_argument("--logp-rtol", type=float, default=DEFAULT_LOGP_RTOL)
    harness.add_results_arguments(parser, RESULTS)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny model of the same family and 64-token sides, on the CPU without a GPU (a smoke run)",
    )
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.impl_list = harness.choices(parser, "--impls", args.impls, IMPLS)
    if not args.impl_list:
        parser.error("--impls: name at least one implementation")
    for name in ("pairs", "seq", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be at least 0 (got {args.warmup_steps})")
    if args.seq < 48:
        parser.error(
            f"--seq must be at least 48 tokens: a side holds the chat template's tokens (got {args.seq})"
        )
    if not 0 < args.perturbation < 1:
        parser.error(f"--perturbation must be in (0, 1) (got {args.perturbation})")
    if args.beta <= 0:
        parser.error(f"--beta must be positive (got {args.beta})")
    if args.tiny and args.seq == parser.get_default("seq"):
        args.seq = 64
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return harness.run_as_worker(run_impl, args._worker, lambda _spec, _error: {})
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print(
            f"{__spec__.name} measures a GPU step; no CUDA device here (--tiny runs on CPU)", file=sys.stderr
        )
        return 2
    folder = Path(tempfile.mkdtemp(prefix="fusetune-dpo-bench-"))
    inputs = prepare_inputs(args, folder)
    print(f"data: {inputs['data']}", flush=True)
    base_spec = {
        **{k: v for k, v in inputs.items() if k != "data"}, "model": args.model, "pairs": args.pairs,
        "seq": args.seq, "beta": args.beta, "warmup_steps": args.warmup_steps, "steps": args.steps,
        "device": device, "tiny": args.tiny,
    }  # fmt: skip

    def run_subprocess(impl: str) -> dict[str, Any]:
        print(f"{impl} ...", flush=True)
        run = harness.run_worker(__spec__.name, ["--_worker", json.dumps({**base_spec, "impl": impl})], 1800)
        row = run.results[-1] if run.results else {"error": short_error(run.failure, 600)}
        print(f"  {json.dumps(row)}", flush=True)
        return row

    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    meta = harness.run_meta(device_name)
    meta["versions"].update(trl=harness.package_version("trl"), datasets=harness.package_version("datasets"))
    slug = harness.results_slug(args, device_name, on_gpu=device == "cuda")
    exact = run_subprocess("exact")
    exact_first = exact.get("first_pairs")
    rows: list[dict[str, Any]] = []

    def write_results() -> str:
        # After every implementation, so that a run cut short keeps the rows it finished.
        payload = {
            **meta,
            "command": f"python3 -m {__spec__.name} " + " ".join(sys.argv[1:]),
            "model": args.model, "pairs": args.pairs, "seq": args.seq, "beta": args.beta,
            "perturbation": args.perturbation, "warmup_steps": args.warmup_steps, "steps": args.steps,
            "data": inputs["data"], "exact_first_pairs": exact_first, "exact_error": exact.get("error"),
            "tolerances": {"reward_atol": args.reward_atol, "logp_rtol": args.logp_rtol},
            "rows": rows, "goals": goals(rows),
        }  # fmt: skip
        RESULTS.write(args.out, slug, payload, args.section)
        return render_markdown(payload)

    for impl in args.impl_list:
        row = {
            "model": args.model,
            "impl": impl,
            "batch": args.pairs,
            "seq": args.seq,
            **run_subprocess(impl),
        }
        row["comparison"] = compare_first_pairs(row, exact_first, args.reward_atol, args.logp_rtol)
        rows.append(row)
        markdown = write_results()
    print(markdown)
    return 0 if not exact.get("error") and all(not r.get("error") or r.get("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
