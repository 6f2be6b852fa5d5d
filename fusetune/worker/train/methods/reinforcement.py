"""Reinforcement fine-tuning by GRPO (group relative policy optimisation): the OpenAI API's `reinforcement` method.

A line of a training file is a prompt (`messages`) with the reference fields its grader reads as `{{item.*}}`
(fusetune/spec/examples.py). A prompt is one row of the run: `batch_size` counts prompts. Each step:

1. Sampling (`prepare_step`, inside the step's time): each rank samples `n` completions of each of its prompts
   with the current policy, Hugging Face `generate` over all its prompts of the step at once (left-padded), at
   `temperature`, from the whole distribution (no top-k or top-p), up to `max_completion_tokens`; on a GPU with
   a static KV cache. A prompt's completions (its group) stay on the rank that sampled them. The sampling seed
   is the job's seed, the number of sampling calls made and the rank: the count is the method's checkpointed
   state, so a resumed run samples what the uninterrupted run sampled.
2. Grading: `fusetune.graders.grade_many` scores each completion as `{{sample.output_text}}`, the special
   tokens left out and the ends stripped, against its line as `{{item}}`. A grader that fails on a completion
   (a python grader that crashes or runs out of time) gives it 0 and the job an event; the job goes on, unless
   it failed on more than MAX_GRADING_ERROR_SHARE of the step's completions (all ranks): then the job fails
   with `grader_error` and the grader's error, as rewards that are mostly failures teach nothing.
3. Advantages, within each group: A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4), std with Bessel's
   correction (as TRL computes it); a group whose completions all score alike teaches nothing (A = 0).
4. The loss, per completion token t of completion i, with the probability ratio rho = pi(t) / pi_old(t):
       l_t = -min(rho * A_i, clip(rho, 1 - eps, 1 + eps) * A_i) + beta * KL_t,
       KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (the k3 estimator, >= 0)
   summed over every completion token of the step on all ranks and divided by their count (token-level
   normalisation, as DAPO and TRL's default). One optimizer step per batch of completions, so pi_old is the
   policy itself (detached): rho = 1 in value and its gradient is the policy gradient, and the clip binds only
   where the sampler's and the trainer's numbers differ (reported as `clip_fraction`). log-probabilities are of
   the logits divided by the sampling temperature.

The per-token log-probabilities come from the fused forward (`token_log_probs=True`,
fusetune.kernels.sequence_log_probs.token_log_probs on the fused linear cross-entropy with reduction "none"),
which holds one chunk of logits at a time and recomputes it in the backward; without the kernels, from the
model's logits. The reference for the KL term (kl_beta > 0) is, with LoRA, the model with its adapters switched
off; for a full fine-tune, a frozen copy of the starting model, loaded only then.

Metrics per step (means over the step's completions unless said): `reward_mean`; `reward_std` (the mean over
groups of the spread within a group, the signal GRPO learns from) and `zero_std_groups` (groups without
spread); `pass_rate_<grader>` (a grader's score at least its pass_threshold, or 1 without one);
`completion_length` in tokens, `truncated_completions` (no end-of-sequence token within
max_completion_tokens); `grading_errors`; `kl` and `clip_fraction` per completion token;
`generated_tokens_per_second` (all ranks), `generation_s` and `grading_s` (mean over ranks); the loop adds
`trained_tokens_per_second` and the step's time. Evaluation (every `eval_interval` steps, at each epoch's end
and at the end) samples one greedy completion of each of the first `eval_samples` validation prompts and
reports `valid_reward_mean` and `valid_pass_rate_<grader>`.

Under DDP and FSDP2 each rank samples for its own prompts; under FSDP2 the weights are gathered whole once for
the whole of sampling (distributed.gathered_for_sampling) rather than layer by layer for every token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from fusetune.config import Settings
from fusetune.graders import grade_many
from fusetune.kernels.sequence_log_probs import token_log_probs_from_logits
from fusetune.models.fused import has_fused_loss
from fusetune.spec.graders import sub_graders
from fusetune.worker.train.data import (
    IGNORE_INDEX,
    LoadedData,
    TokenizedSequence,
    TrainingDataError,
    collate,
    model_inputs,
)
from fusetune.worker.train.distributed import all_reduce, gathered_for_sampling, synchronize
from fusetune.worker.train.methods.base import TrainingMethod
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure

# Added to a group's reward spread before dividing by it, so that a group of equal rewards gets advantage 0
# rather than 0 / 0 (TRL's value).
ADVANTAGE_EPSILON = 1e-4
# A step whose grader failed on more than this share of its completions fails the job: its scores of 0 are the
# grader's failures, not the completions', and a job trained on them would end "succeeded" having learned nothing.
MAX_GRADING_ERROR_SHARE = 0.5


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Each reward's advantage within its group (consecutive runs of `group_size`): (r - group mean) / (group
    std + ADVANTAGE_EPSILON)."""
    groups = rewards.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + ADVANTAGE_EPSILON)).reshape(-1)


def grpo_token_losses(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    clip_epsilon: float,
    kl_beta: float,
    reference_log_probs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per token of [rows, length] log-probabilities: the clipped policy-gradient loss plus `kl_beta` times the
    KL estimate to the reference, the KL estimate (0 without a reference), and where the clip binds."""
    ratio = torch.exp(log_probs - old_log_probs)
    advantage = advantages.unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1 - clip_epsilon, 1 + clip_epsilon) * advantage
    losses = -torch.minimum(unclipped, clipped)
    if reference_log_probs is None:
        return losses, torch.zeros_like(losses), clipped < unclipped
    log_ratio = reference_log_probs - log_probs
    kl = torch.exp(log_ratio) - log_ratio - 1
    return losses + kl_beta * kl, kl, clipped < unclipped


@dataclass(frozen=True)
class Prompt:
    """One row of a reinforcement run: a line's messages through the chat template, ending with the assistant's
    generation prompt, and the line itself (what the grader reads as `{{item.*}}`)."""

    index: int
    input_ids: list[int]
    item: dict[str, Any]


class GroupRelativePolicyOptimization(TrainingMethod):
    type = "reinforcement"
    eval_sum_names: tuple[str, ...] = ()  # set per grader in __init__
    # On a GPU, sampling keeps its KV cache in one static buffer (what compiling the decoding step needs), and
    # Hugging Face compiles that step with `compile_generation`. benchmarks/step/generation.py on one H100,
    # Llama-3.2-1B shape, 64 prompts x 8 x 256 tokens (h100-step.json, section generation): 14.2 ms a token
    # step compiled over the static cache against 27.1 eager over the dynamic one.
    static_cache: ClassVar[bool] = True
    compile_generation: ClassVar[bool] = True
    # The compiled decoding step is specialised to the cache's length, the prompts' padded width plus the
    # completion's: a step whose prompts pad to a width not seen before compiles again (28.5 s against a 3.6 s
    # generate in the same benchmark), and past Dynamo's recompile limit sampling falls back to eager. So over
    # a static cache the prompts are left-padded to the next power of two, at least this many tokens: a run
    # compiles once per width class, a handful at most.
    STATIC_PROMPT_WIDTH_MIN: ClassVar[int] = 16

    def __init__(self, config: Any, tokenizer: Any, pad_token_id: int) -> None:
        super().__init__(config, tokenizer, pad_token_id)
        self.settings = config.method.settings
        self.group_size = self.settings.completions_per_prompt
        self.graders = sub_graders(self.settings.grader)
        # The server's limits for python graders, which the worker hands to the trainer's environment.
        self.grading_settings = Settings()
        self.eval_sum_names = (
            "reward",
            "prompts",
            "grading_errors",
            *(f"pass_{name}" for name in self.graders),
        )
        self.step_metric_names = (
            "reward_mean", "reward_std", "zero_std_groups", *(f"pass_rate_{name}" for name in self.graders),
            "completion_length", "truncated_completions", "grading_errors", "generated_tokens_per_second",
            "generation_s", "grading_s",
        )  # fmt: skip
        eos = tokenizer.eos_token_id
        self.eos_token_ids = {eos} if eos is not None else set()
        self.generations = 0  # sampling calls made: the next one's seed
        self.fused_forward = False
        self.reference_model: torch.nn.Module | None = None
        self.rank, self.world_size = 0, 1

    @property
    def eval_every_steps(self) -> int | None:
        return self.settings.eval_interval or self.config.eval_every_steps

    # ------------------------------------------------------------------------------------------------ data

    def load_data(self, path: str, packing: bool) -> LoadedData:
        if packing:
            raise TrainingDataError(
                "packing is not available with the reinforcement method: a prompt is one row"
            )
        examples = self.read_examples(path)
        prompts: list[Prompt] = []
        n_dropped = 0
        for line_index, example in enumerate(examples):
            try:
                input_ids = list(
                    self.tokenizer.apply_chat_template(
                        example.messages, add_generation_prompt=True, tokenize=True, return_dict=True
                    )["input_ids"]
                )
            except Exception as exc:  # a template may raise on content it does not accept
                raise TrainingDataError(
                    f"{Path(path).name}, example {line_index + 1}: the chat template failed: {exc}"
                ) from exc
            if len(input_ids) > self.config.max_seq_length:
                n_dropped += 1
                continue
            prompts.append(Prompt(line_index, input_ids, example.item))
        if not prompts:
            raise TrainingDataError(
                f"{Path(path).name}: no prompt fits within max_seq_length={self.config.max_seq_length}"
            )
        return LoadedData(prompts, len(examples), 0, n_dropped)

    def row_length(self, row: Prompt) -> int:
        # What a prompt becomes in training: its completions, each at most max_completion_tokens long.
        return self.group_size * (len(row.input_ids) + self.settings.max_completion_tokens)

    def collate(self, rows: Sequence[Prompt], packed: bool) -> dict[str, Any]:
        """Prompts left-padded for sampling (`prompts` keeps the rows for the step to grade against)."""
        width = max(len(row.input_ids) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, width - len(row.input_ids) :] = torch.tensor(row.input_ids)
            attention_mask[index, width - len(row.input_ids) :] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "n_input_tokens": attention_mask.sum(),
            "prompts": list(rows),
        }

    def loss_normaliser(self, batch: dict[str, Any]) -> int:
        return int(batch["n_trained_tokens"])

    # --------------------------------------------------------------------------------------- before training

    def before_training(self, trainer: Any) -> None:
        self.rank, self.world_size = trainer.dist.rank, trainer.dist.world_size
        # A completion also ends at any end-of-sequence token the model's generation config names (an instruct
        # model's end of turn).
        generation_eos = getattr(getattr(trainer.model, "generation_config", None), "eos_token_id", None)
        if generation_eos is not None:
            self.eos_token_ids |= set(
                generation_eos if isinstance(generation_eos, list) else [generation_eos]
            )
        if trainer.valid_data is not None and self.settings.eval_samples is not None:
            # Evaluation samples the first eval_samples prompts of the validation file.
            prompts = trainer.valid_data.sequences[: self.settings.eval_samples]
            trainer.valid_data = dataclasses.replace(trainer.valid_data, sequences=prompts)
        self.fused_forward = trainer.kernels_applied and self._fused_log_probs(trainer.model)
        if self.settings.kl_beta > 0 and self.config.lora is None and self.reference_model is None:
            # The starting model, also when the run resumes from later weights.
            reference = trainer._load_model(self.config.model_path, trainer.precision.weight_dtype)
            reference = reference.to(trainer.device).eval().requires_grad_(False)
            if trainer.kernels_applied:
                from fusetune.models import apply_fusetune

                apply_fusetune(reference, strict=False, probe_device=trainer.device)
            self.reference_model = reference
            trainer.reporter.event(
                "Reference model for the KL term loaded (a frozen copy of the starting model)",
                data={"event": "reference_ready"},
            )

    def _fused_log_probs(self, model: torch.nn.Module) -> bool:
        """Whether `model` scores tokens through the fused forward at the sampling temperature (the kernel
        cannot divide soft-capped logits by a temperature)."""
        softcapped = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
        return has_fused_loss(model) and (self.settings.temperature == 1 or not softcapped)

    # ------------------------------------------------------------------------------------------------ sampling

    def _generate(
        self, model: torch.nn.Module, batch: dict[str, Any], group_size: int, sample: bool
    ) -> list[list[int]]:
        """Completions of the batch's prompts, `group_size` each (a prompt's consecutive), as token lists that end
        with the end-of-sequence token when one was sampled: sampled at the temperature, or greedy."""
        from transformers import GenerationConfig

        device = batch["input_ids"].device
        options: dict[str, Any] = dict(
            max_new_tokens=self.settings.max_completion_tokens,
            num_return_sequences=group_size,
            pad_token_id=self.pad_token_id,
            eos_token_id=sorted(self.eos_token_ids) or None,
            use_cache=True,
        )
        if sample:
            options.update(do_sample=True, temperature=self.settings.temperature, top_k=0, top_p=1.0)
        else:
            options.update(do_sample=False)
        sharded = isinstance(model, FSDPModule)  # shard_fsdp makes the model itself the root unit
        if device.type == "cuda" and self.static_cache:
            # Under FSDP the decoding step runs eagerly: its gathered weights need not keep one address between
            # steps, which CUDA graphs of a compiled step would need.
            options.update(
                cache_implementation="static", disable_compile=sharded or not self.compile_generation
            )
            batch = self.padded_to_width_class(batch)
        was_training = model.training
        model.eval()
        with torch.no_grad(), gathered_for_sampling(model):
            output = model.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                generation_config=GenerationConfig(**options),
            )
        model.train(was_training)
        completions = []
        for row in output[:, batch["input_ids"].shape[1] :].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in self.eos_token_ids), len(row))
            completions.append(row[:end])
        return completions

    def padded_to_width_class(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch's prompts left-padded further, to the next power of two of their width (at least
        STATIC_PROMPT_WIDTH_MIN): the widths a static cache, and so the compiled decoding step, ever sees."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        width = input_ids.shape[1]
        target = max(self.STATIC_PROMPT_WIDTH_MIN, 1 << max(width - 1, 0).bit_length())
        if target == width:
            return batch
        extra = target - width
        return {
            **batch,
            "input_ids": torch.nn.functional.pad(input_ids, (extra, 0), value=self.pad_token_id),
            "attention_mask": torch.nn.functional.pad(attention_mask, (extra, 0), value=0),
        }

    def _grade(self, prompts: Sequence[Prompt], completions: list[list[int]], group_size: int):
        texts = [self.tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in completions]
        items = [prompt.item for prompt in prompts for _ in range(group_size)]
        return grade_many(self.settings.grader, texts, items, self.grading_settings)

    def _passed(self, results: Sequence[Any]) -> list[list[float]]:
        """Per grader, 1.0 for each result whose score reaches the grader's pass_threshold (1 without one)."""
        passed = []
        for name, grader in self.graders.items():
            threshold = getattr(grader, "pass_threshold", None)
            threshold = 1.0 if threshold is None else threshold
            passed.append(
                [float(result.per_grader.get(name, result.score) >= threshold) for result in results]
            )
        return passed

    def prepare_step(self, trainer: Any, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Sample, grade and score this rank's prompts of the step: the training micro-batches, one per micro-batch
        of prompts (its completions, right-padded, labelled on the completion tokens), with their advantages,
        reference log-probabilities (kl_beta > 0) and the step's metric shares."""
        G = self.group_size
        prompts = [prompt for batch in micro_batches for prompt in batch["prompts"]]
        started = time.perf_counter()
        prompt_batch = trainer._batch(prompts, False)
        devices = [trainer.device] if trainer.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            seed = (self.config.seed * 1_000_003 + self.generations) * 1_009 + self.rank
            torch.manual_seed(seed)
            completions = self._generate(trainer.model, prompt_batch, G, sample=True)
        self.generations += 1
        synchronize(trainer.device)
        generation_s = time.perf_counter() - started
        started = time.perf_counter()
        results = self._grade(prompts, completions, G)
        grading_s = time.perf_counter() - started
        self._report_grading_errors(trainer, results)
        self._fail_if_grading_failed(trainer, results)

        rewards = torch.tensor([result.score for result in results], dtype=torch.float32)
        advantages = group_advantages(rewards, G)
        passed = torch.tensor(self._passed(results), dtype=torch.float32).reshape(len(self.graders), -1)
        lengths = torch.tensor([len(tokens) for tokens in completions], dtype=torch.float32)
        truncated = torch.tensor(
            [float(not tokens or tokens[-1] not in self.eos_token_ids) for tokens in completions]
        )
        errors = torch.tensor([float(result.error is not None) for result in results])
        n_completions = self.config.batch_size * G  # of the step, all ranks
        n_groups = self.config.batch_size

        training_batches = []
        first = 0
        for index, batch in enumerate(micro_batches):
            rows = slice(first * G, (first + len(batch["prompts"])) * G)
            group_rewards = rewards[rows].view(-1, G)
            group_std = group_rewards.std(dim=1)
            timing = (
                [
                    lengths.sum().item() / generation_s,
                    generation_s / self.world_size,
                    grading_s / self.world_size,
                ]
                if index == 0
                else [0.0, 0.0, 0.0]
            )
            shares = [
                rewards[rows].sum().item() / n_completions,
                group_std.sum().item() / n_groups,
                (group_std == 0).sum().item() / n_groups,
                *(passed[g, rows].sum().item() / n_completions for g in range(len(self.graders))),
                lengths[rows].sum().item() / n_completions,
                truncated[rows].sum().item() / n_completions,
                errors[rows].sum().item() / n_completions,
                *timing,
            ]
            sequences = [
                self._training_row(prompt, completions[first * G + offset])
                for offset, prompt in enumerate(p for p in batch["prompts"] for _ in range(G))
            ]
            training = collate(
                sequences, self.pad_token_id, packed=False, length_multiple=self.length_multiple
            )
            training["advantages"] = advantages[rows]
            training["step_metrics"] = torch.tensor(shares, dtype=torch.float32)
            training = {
                key: value.to(trainer.device, non_blocking=True)
                if isinstance(value, torch.Tensor) and value.ndim
                else value
                for key, value in training.items()
            }
            if self.settings.kl_beta > 0:
                training["reference_log_probs"] = self._reference_log_probs(trainer, training)
            training_batches.append(training)
            first += len(batch["prompts"])
        return training_batches

    @staticmethod
    def _training_row(prompt: Prompt, completion: list[int]) -> TokenizedSequence:
        input_ids = prompt.input_ids + completion
        start = len(prompt.input_ids)
        labels = [input_ids[i + 1] if i + 1 >= start else IGNORE_INDEX for i in range(len(input_ids) - 1)]
        return TokenizedSequence(input_ids, [*labels, IGNORE_INDEX], list(range(len(input_ids))))

    def _report_grading_errors(self, trainer: Any, results: Sequence[Any]) -> None:
        failed = [result for result in results if result.error is not None]
        if failed:
            trainer.reporter.event(
                f"The grader failed on {len(failed)} of {len(results)} completions of step {trainer.step + 1} "
                f"(scored 0): {failed[0].error}",
                level="warning",
                data={"event": "grading_errors", "step": trainer.step + 1, "failed": len(failed),
                      "completions": len(results), "first_error": failed[0].error},
            )  # fmt: skip

    def _fail_if_grading_failed(self, trainer: Any, results: Sequence[Any]) -> None:
        """Raises TrainingFailure (grader_error) when the grader failed on more than MAX_GRADING_ERROR_SHARE of
        the step's completions on all ranks."""
        failed = [result for result in results if result.error is not None]
        # Summed over the ranks, so that every rank stops at the same step (one that went on would wait for the
        # others in the step's collectives). The counts are read back once a step, after grading on the host.
        counts = torch.tensor([len(failed), len(results)], dtype=torch.int64, device=trainer.device)
        n_failed, n_graded = all_reduce(counts).tolist()
        if n_failed <= MAX_GRADING_ERROR_SHARE * n_graded:
            return
        first = failed[0] if failed else None
        kind = f" ({first.error_type})" if first is not None and getattr(first, "error_type", None) else ""
        raise TrainingFailure(
            ErrorCode.GRADER_ERROR,
            f"the grader failed on {n_failed} of {n_graded} completions of step {trainer.step + 1}{kind}: "
            f"{first.error if first is not None else 'on the other processes'}",
        )

    def _reference_log_probs(self, trainer: Any, batch: dict[str, Any]) -> Tensor:
        if self.reference_model is not None:
            model, fused, off = self.reference_model, self._fused_log_probs(self.reference_model), None
        else:  # LoRA: the base model is the adapters switched off
            model, fused, off = trainer.model, self.fused_forward, trainer.model.disable_adapter()
        was_training = model.training
        model.eval()
        with torch.no_grad(), off or contextlib.nullcontext(), trainer._autocast():
            log_probs = self._token_log_probs(model, batch, fused).float()
        model.train(was_training)
        return log_probs

    # ---------------------------------------------------------------------------------------------- the loss

    def _token_log_probs(self, model: torch.nn.Module, batch: dict[str, Any], fused: bool) -> Tensor:
        labels = batch["shifted_labels"]
        inputs = model_inputs(batch)
        temperature = self.settings.temperature
        if fused:
            return model(
                **inputs, labels=labels, shift_labels=labels, token_log_probs=True,
                logits_temperature=temperature, use_cache=False,
            ).loss  # fmt: skip
        logits = model(**inputs, use_cache=False).logits
        return token_log_probs_from_logits(logits / temperature, labels)

    def loss(
        self, model: torch.nn.Module, batch: dict[str, Any], normaliser: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        log_probs = self._token_log_probs(model, batch, self.fused_forward)
        trained = batch["shifted_labels"] != IGNORE_INDEX
        reference = batch.get("reference_log_probs")
        losses, kl, clipped = grpo_token_losses(
            log_probs,
            batch["old_log_probs"] if "old_log_probs" in batch else log_probs.detach(),
            batch["advantages"].to(log_probs.dtype),
            self.settings.clip_epsilon,
            self.settings.kl_beta,
            reference.to(log_probs.dtype) if reference is not None else None,
        )
        normaliser = normaliser.to(log_probs.device, log_probs.dtype)
        metrics = dict(zip(self.step_metric_names, batch["step_metrics"].unbind(), strict=True))
        metrics["kl"] = (kl * trained).sum() / normaliser
        metrics["clip_fraction"] = (clipped & trained).sum() / normaliser
        return (losses * trained).sum() / normaliser, metrics

    # ------------------------------------------------------------------------------------------- evaluation

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, Any]) -> Tensor:
        prompts = batch["prompts"]
        completions = self._generate(model, batch, 1, sample=False)
        results = self._grade(prompts, completions, 1)
        passed = self._passed(results)
        errors = sum(result.error is not None for result in results)
        sums = [
            sum(result.score for result in results),
            float(len(prompts)),
            float(errors),
            *(sum(p) for p in passed),
        ]
        return torch.tensor(sums, dtype=torch.float64, device=batch["input_ids"].device)

    def eval_metrics(self, sums: list[float]) -> dict[str, float]:
        reward, prompts, errors, *passed = sums
        # The same rule as a training step's: a validation score made mostly of failures measures nothing. Every
        # rank reads the same summed counts, so every rank stops here together.
        if errors > MAX_GRADING_ERROR_SHARE * prompts:
            raise TrainingFailure(
                ErrorCode.GRADER_ERROR,
                f"the grader failed on {errors:.0f} of {prompts:.0f} validation completions; the first failures "
                "of training steps are in the job's grading_errors events",
            )
        return {
            "valid_reward_mean": reward / prompts,
            **{f"valid_pass_rate_{name}": p / prompts for name, p in zip(self.graders, passed, strict=True)},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"generations": self.generations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generations = int(state.get("generations", 0))
