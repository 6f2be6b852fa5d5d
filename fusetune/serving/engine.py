"""The serving engine: chat completions on a worker, with the models it loaded kept warm until they idle.

Iteration-level batching: one scheduler thread runs every sequence in flight; a request that arrives is
prefilled (its prompt, alone) between two decoding steps and joins the next step, and a sequence that ends
leaves the batch at once. A step decodes one token of every sequence of a model together: each sequence keeps
its own KV cache, and the step left-pads the caches to the longest, stacks them into one batch with an attention
mask over the padding, runs the model once, and splits the grown cache back per sequence.

Why this loop and not transformers' own continuous batching (`generate_batch` / `init_continuous_batching`,
transformers 5.24): that one runs on CPU, but it takes one generation config for all its requests (no
per-request temperature, top_p or seed, which OpenAI's API has) and it sized a paged cache that took 43 s for
8 tokens of two requests of the tiny model on the 2-core CPU machine. The per-sequence caches here copy the
cache each step: cheap for the short sequences of CPU tests, and the place a static-cache, compiled decoding step
(the reinforcement method's sampler) would go for GPU throughput.

Sampling: temperature 0 is greedy; otherwise softmax(logits / temperature), cut to the smallest set of tokens
whose probability reaches top_p, drawn with a generator per completion seeded from the request's `seed` and the
completion's index, so a seeded request gives the same completions streamed or not (when it runs in the same
batch: a padded batch computes in another order, which can move the last bits of a logit).
A completion ends at one of the model's end-of-turn tokens (the tokenizer's eos and the generation config's),
at a stop string (left out of the text), or at its token limit, or the end of the model's context.
"""

from __future__ import annotations

import gc
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fusetune.serving.errors import ServingError
from fusetune.spec.chat import ChatCompletionCreate
from fusetune.worker.train.loading import load_model, load_tokenizer
from fusetune.worker.train.outcome import TrainingFailure

log = logging.getLogger(__name__)

# What a request hears about, from the scheduler's thread: ("delta", choice, text), ("finish", choice, reason),
# ("usage", prompt_tokens, completion_tokens) once all its choices ended, or ("error", status, message).
Event = tuple[str, Any, Any]


@dataclass
class LoadedModel:
    key: str
    model: Any
    tokenizer: Any
    eos_token_ids: set[int]
    context_tokens: int
    last_used: float = field(default_factory=time.monotonic)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass
class Sequence:
    request: Request
    index: int  # the choice's index
    generator: torch.Generator
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    # The KV cache of prompt and completion so far, per layer (keys, values), each [1, kv_heads, length, head_dim].
    cache: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    next_token: int | None = None
    text: str = ""
    sent_chars: int = 0
    finish_reason: str | None = None


@dataclass
class Request:
    loaded: LoadedModel
    prompt_ids: list[int]
    body: ChatCompletionCreate
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    sequences: list[Sequence] = field(default_factory=list)


def _pad_left(tensor: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - tensor.shape[2]
    return torch.nn.functional.pad(tensor, (0, 0, missing, 0)) if missing else tensor


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (shorter than all of it)."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from a row of logits: greedy at temperature 0, else nucleus sampling at the temperature."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is below top_p: the smallest set that reaches it, at least one.
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class Engine:
    """Runs chat completions in one scheduler thread on the models it loaded, each known by a key (its location)."""

    def __init__(self, idle_s: float, max_batch: int, device: torch.device | None = None):
        self.idle_s = idle_s
        self.max_batch = max_batch
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._models: dict[str, LoadedModel] = {}
        self._load_locks: dict[str, threading.Lock] = {}
        self._waiting: list[Request] = []
        self._running: list[Sequence] = []
        self._lock = threading.Condition()
        self._paused = False
        self._stopped = False
        self._thread = threading.Thread(target=self._schedule, name="fusetune-serving", daemon=True)
        self._thread.start()

    # ---- called from request threads ---------------------------------------------------------------------

    def submit(
        self,
        key: str,
        load: Callable[[], tuple[Any, Any]],
        body: ChatCompletionCreate,
        emit: Callable[[Event], None],
    ) -> Request:
        """Loads the model with `load` (model, tokenizer) unless it is loaded (in the caller's thread: the others'
        decoding goes on), checks the prompt and queues the request; raises ServingError for what the request
        cannot have."""
        loaded = self._model(key, load)
        try:
            prompt_ids = list(
                loaded.tokenizer.apply_chat_template(
                    body.template_messages(), add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
        except Exception as exc:  # a template may raise on a conversation it does not accept
            raise ServingError(400, f"The model's chat template refused the messages: {exc}", "messages",
                               "invalid_messages") from exc  # fmt: skip
        if len(prompt_ids) >= loaded.context_tokens:
            raise ServingError(400, f"The messages are {len(prompt_ids)} tokens; the model's context is "
                               f"{loaded.context_tokens}.", "messages", "context_length_exceeded")  # fmt: skip
        request = Request(loaded, prompt_ids, body, emit)
        max_tokens = min(body.completion_token_limit, loaded.context_tokens - len(prompt_ids))
        base_seed = body.seed if body.seed is not None else secrets.randbits(62)
        for index in range(body.choices):
            generator = torch.Generator(device=loaded.device)
            generator.manual_seed((base_seed * 1_000_003 + index) % (1 << 63))
            request.sequences.append(Sequence(request, index, generator, max_tokens))
        with self._lock:
            if self._paused:
                raise ServingError(503, "The worker is training a job; chat completions resume after it.",
                                   code="worker_training")  # fmt: skip
            self._waiting.append(request)
            self._lock.notify_all()
        return request

    def pause(self) -> None:
        """Training takes the worker's devices: requests in flight end with an error, every model is unloaded,
        and new requests are refused until `resume`."""
        with self._lock:
            self._paused = True
            self._fail_all(
                503, "The worker started a training job, which takes its GPUs; retry on another worker."
            )
            self._unload(list(self._models))

    def resume(self) -> None:
        with self._lock:
            self._paused = False

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._fail_all(503, "The worker is stopping.")
            self._lock.notify_all()
        self._thread.join(timeout=10)

    @property
    def loaded_models(self) -> list[str]:
        with self._lock:
            return list(self._models)

    # ---- loading -----------------------------------------------------------------------------------------

    def load_model(self, location: str, adapter_base_models: Mapping[str, str]) -> tuple[Any, Any]:
        """The model at `location` (a LoRA checkpoint merged over its bases) and its tokenizer, in the dtype of the
        engine's device: what a `load` passed to `submit` does for a model the worker found."""
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        try:
            tokenizer = load_tokenizer(location)
        except TrainingFailure:  # a checkpoint without its tokenizer: its base's
            tokenizer = load_tokenizer(next(reversed(adapter_base_models.values()), location))
        return load_model(location, dtype, adapter_base_models), tokenizer

    def _model(self, key: str, load: Callable[[], tuple[Any, Any]]) -> LoadedModel:
        with self._lock:
            if self._paused:
                raise ServingError(503, "The worker is training a job; chat completions resume after it.",
                                   code="worker_training")  # fmt: skip
            loaded = self._models.get(key)
            if loaded is not None:
                loaded.last_used = time.monotonic()
                return loaded
            load_lock = self._load_locks.setdefault(key, threading.Lock())
        with load_lock:  # one load per model, however many requests ask for it at once
            with self._lock:
                if key in self._models:
                    return self._models[key]
            model, tokenizer = load()
            model = model.to(self.device).eval().requires_grad_(False)
            eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
            generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            if generation_eos is not None:
                eos |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
            context = getattr(model.config, "max_position_embeddings", None) or 2048
            loaded = LoadedModel(key, model, tokenizer, eos, int(context))
            with self._lock:
                if self._paused:  # a training job started while this loaded
                    raise ServingError(503, "The worker is training a job; chat completions resume after it.",
                                       code="worker_training")  # fmt: skip
                self._models[key] = loaded
            log.info("serving: loaded %s", key)
            return loaded

    def _unload(self, keys: list[str]) -> None:
        for key in keys:
            self._models.pop(key, None)
            log.info("serving: unloaded %s", key)
        if keys:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _fail_all(self, status: int, message: str) -> None:
        requests = {id(s.request): s.request for s in self._running} | {id(r): r for r in self._waiting}
        for request in requests.values():
            request.emit(("error", status, message))
        self._running, self._waiting = [], []

    # ---- the scheduler thread ----------------------------------------------------------------------------

    def _schedule(self) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._running or self._stopped):
                    if not self._lock.wait(timeout=min(self.idle_s, 30.0)):
                        self._unload_idle()
                if self._stopped:
                    return
                try:
                    self._admit()
                    self._step()
                except Exception as exc:  # one bad step must not end serving
                    log.exception("serving: a decoding step failed")
                    self._fail_all(500, f"Generation failed: {type(exc).__name__}")
                self._unload_idle()

    def _unload_idle(self) -> None:
        in_use = {s.request.loaded.key for s in self._running} | {r.loaded.key for r in self._waiting}
        now = time.monotonic()
        idle = [k for k, m in self._models.items() if k not in in_use and now - m.last_used > self.idle_s]
        self._unload(idle)

    def _admit(self) -> None:
        """Prefill waiting requests while the batch has room: each prompt alone, its first token sampled, its
        completions sharing the prompt's cache."""
        # A request whose n alone exceeds max_batch runs when the batch is empty.
        while self._waiting and (
            not self._running or len(self._running) + self._waiting[0].body.choices <= self.max_batch
        ):
            request = self._waiting.pop(0)
            if request.cancelled.is_set():
                continue
            loaded = request.loaded
            loaded.last_used = time.monotonic()
            input_ids = torch.tensor([request.prompt_ids], device=loaded.device)
            with torch.no_grad():
                output = loaded.model(input_ids=input_ids, use_cache=True)
            cache = [(layer.keys, layer.values) for layer in output.past_key_values.layers]
            for sequence in request.sequences:
                sequence.cache = cache
                self._append(sequence, output.logits[0, -1])
                if sequence.finish_reason is None:
                    self._running.append(sequence)

    def _step(self) -> None:
        """One token of every running sequence, the sequences of one model in one forward pass."""
        self._running = [s for s in self._running if not s.request.cancelled.is_set()]
        by_model: dict[str, list[Sequence]] = {}
        for sequence in self._running:
            by_model.setdefault(sequence.request.loaded.key, []).append(sequence)
        for sequences in by_model.values():
            self._decode(sequences)
        self._running = [s for s in self._running if s.finish_reason is None]

    def _decode(self, sequences: list[Sequence]) -> None:
        from transformers import DynamicCache

        loaded = sequences[0].request.loaded
        device = loaded.device
        lengths = [s.cache[0][0].shape[2] for s in sequences]
        width = max(lengths)
        cache = DynamicCache(config=loaded.model.config)
        for layer_index in range(len(sequences[0].cache)):
            keys = torch.cat([_pad_left(s.cache[layer_index][0], width) for s in sequences])
            values = torch.cat([_pad_left(s.cache[layer_index][1], width) for s in sequences])
            cache.update(keys, values, layer_index)
        attention_mask = torch.zeros((len(sequences), width + 1), dtype=torch.long, device=device)
        for row, length in enumerate(lengths):
            attention_mask[row, width - length :] = 1
        input_ids = torch.tensor([[s.next_token] for s in sequences], device=device)
        position_ids = torch.tensor([[length] for length in lengths], device=device)
        with torch.no_grad():
            output = loaded.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
        layers = output.past_key_values.layers
        for row, (sequence, length) in enumerate(zip(sequences, lengths, strict=True)):
            start = width - length  # the padding this sequence's rows began with
            sequence.cache = [
                (layer.keys[row : row + 1, :, start:], layer.values[row : row + 1, :, start:])
                for layer in layers
            ]
            self._append(sequence, output.logits[row, -1])
        loaded.last_used = time.monotonic()

    def _append(self, sequence: Sequence, logits: torch.Tensor) -> None:
        """Sample the sequence's next token from `logits`, and tell the request what changed."""
        body = sequence.request.body
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        token = sample_token(logits, temperature, top_p, sequence.generator)
        loaded = sequence.request.loaded
        if token in loaded.eos_token_ids:
            self._finish(sequence, "stop", sequence.text)
            return
        sequence.tokens.append(token)
        sequence.next_token = token
        text = loaded.tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        stops = body.stop_sequences
        # A stop string may have begun in text already sent only if it is longer than what came after it.
        search_from = max(0, sequence.sent_chars - max((len(s) for s in stops), default=0))
        found = [at for stop in stops if (at := text.find(stop, search_from)) >= 0]
        if found:
            self._finish(sequence, "stop", text[: min(found)])
            return
        if len(sequence.tokens) >= sequence.max_tokens:
            self._finish(sequence, "length", text)
            return
        sequence.text = text
        # Held back: an unfinished character (a token that ends mid UTF-8 sequence), and any end of the text that
        # could be the start of a stop string.
        safe = len(text.rstrip("\ufffd"))
        safe -= max((_overlap(text[:safe], stop) for stop in stops), default=0)
        if safe > sequence.sent_chars:
            sequence.request.emit(("delta", sequence.index, text[sequence.sent_chars : safe]))
            sequence.sent_chars = safe

    def _finish(self, sequence: Sequence, reason: str, text: str) -> None:
        request = sequence.request
        if len(text) > sequence.sent_chars:
            request.emit(("delta", sequence.index, text[sequence.sent_chars :]))
        sequence.text, sequence.sent_chars, sequence.finish_reason = text, len(text), reason
        sequence.cache = []
        request.emit(("finish", sequence.index, reason))
        if all(s.finish_reason is not None for s in request.sequences):
            completion_tokens = sum(len(s.tokens) for s in request.sequences)
            request.emit(("usage", len(request.prompt_ids), completion_tokens))
