"""The serving engine: chat completions on a worker, with the models it loaded kept warm until they idle.

Iteration-level batching: one scheduler thread runs every sequence in flight; the requests that arrive are
prefilled between two decoding steps (all that arrived during a step, their prompts packed into one forward,
each attending only to itself) and join the next step, and a sequence that ends leaves the batch at once. Each
loaded model has a fixed number of slots (FUSETUNE_SERVING_MAX_BATCH) of a KV cache of fixed length
(FUSETUNE_SERVING_MAX_LEN, or the model's context if shorter); a sequence in flight owns one, a request whose
completions find too few free slots waits for them, and a decoding step runs all of a model's slots at once, at
one shape (fusetune/serving/slots.py says how the cache is laid out and why). That is the sampling path of the
reinforcement method: on a GPU the model is patched with fusetune's kernels (apply_fusetune), its
one-token steps read the cache through the decode-attention kernel (fusetune/kernels/decode_attention.py, which
skips the columns a row's mask leaves out), and the step is compiled once and replayed as CUDA graphs. On CPU the
same slots and steps run eagerly, with the same attention routing (fusetune_varlen, whose decoding step over the
grouped query rows falls back to scaled_dot_product_attention in float32): the tests run this path.

Why this loop and not transformers' own continuous batching (`generate_batch` / `init_continuous_batching`,
transformers 5.24): that one runs on CPU, but it takes one generation config for all its requests (no
per-request temperature, top_p or seed, which OpenAI's API has) and it sized a paged cache that took 43 s for
8 tokens of two requests of the tiny model on the 2-core CPU machine.

Sampling (fusetune/serving/sampling.py): temperature 0 is greedy; otherwise softmax(logits / temperature), cut to
the smallest set of tokens whose probability reaches top_p, every row of a step drawn at once on the device by a
counter-based draw keyed on (the completion's seed, its token's index). The seed comes from the request's `seed`
and the completion's index, so a seeded request gives the same completions streamed or not and whatever else is
in the batch (its logits permitting: the step runs every slot at one shape, so a row's logits do not depend on
the other rows; a prompt's prefill, packed with the prompts that arrived with it, attends only to itself, but its
matmuls run over the packed row, whose length may change their last bits).
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

from fusetune.serving.detokenize import IncrementalDecoder
from fusetune.serving.errors import ServingError
from fusetune.serving.sampling import sample_rows, uniforms
from fusetune.serving.slots import CUDA_STEP_COMPILE, SlotBatch
from fusetune.spec.chat import ChatCompletionCreate
from fusetune.worker.train.loading import load_model, load_tokenizer
from fusetune.worker.train.outcome import TrainingFailure

log = logging.getLogger(__name__)

# The most prompt tokens one prefill packs (the requests beyond wait for the next): a bound on one prefill's
# activations and on how long it holds up the decoding steps of the sequences already running. On a CPU the packed
# prompts attend through scaled_dot_product_attention with the block-diagonal mask, whose float32 scores are
# [heads, tokens, tokens] (4 MB a head at 1,024 tokens, 256 MB at 8,192), where the GPU's variable-length kernel
# computes each prompt's own block only.
PREFILL_TOKENS = {"cuda": 8192, "cpu": 1024}

# What a request hears about, from the scheduler's thread: ("delta", choice, text), ("finish", choice, reason),
# ("usage", prompt_tokens, completion_tokens) once all its choices ended, or ("error", status, message).
Event = tuple[str, Any, Any]


@dataclass
class LoadedModel:
    key: str
    model: Any
    tokenizer: Any
    eos_token_ids: set[int]
    context_tokens: int  # the model's context, or the slots' columns if fewer: a sequence's longest
    slots: SlotBatch
    last_used: float = field(default_factory=time.monotonic)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass
class Sequence:
    request: Request
    index: int  # the choice's index
    seed: int  # the draws' key with the token's index (fusetune/serving/sampling.py)
    temperature: float  # 0: greedy
    top_p: float
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    row: int | None = None  # the slot it owns while it decodes
    decoder: IncrementalDecoder | None = None
    text: str = ""  # whole characters only: an unfinished one's tokens wait in the decoder
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


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (shorter than all of it)."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0


def patch_for_decoding(model: Any) -> None:
    """On a GPU, fusetune's kernels (the decoding step's attention among them); on CPU only the attention routing
    (fusetune_varlen: one-token steps through grouped_query_decode), so CPU tests run the GPU's code path."""
    if next(model.parameters()).device.type == "cuda":
        from fusetune.models import apply_fusetune

        apply_fusetune(model, strict=False)
    else:
        from fusetune.models.attention import register_varlen_attention, switch_to_varlen_attention

        register_varlen_attention()
        switch_to_varlen_attention(model)


class Engine:
    """Runs chat completions in one scheduler thread on the models it loaded, each known by a key (its location)."""

    def __init__(
        self,
        idle_s: float,
        max_batch: int,
        device: torch.device | None = None,
        max_len: int = 4096,
        step_compile: dict[str, Any] | None | str = "auto",
    ):
        self.idle_s = idle_s
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.max_batch = max_batch  # each model's slots
        self.max_len = max_len  # each slot's cache columns (at most the model's context)
        self._prefill_tokens = PREFILL_TOKENS.get(self.device.type, PREFILL_TOKENS["cpu"])
        # torch.compile's options for the decoding step, None for eager; "auto": CUDA graphs on a GPU, eager on CPU.
        if step_compile == "auto":
            step_compile = CUDA_STEP_COMPILE if self.device.type == "cuda" else None
        self.step_compile = step_compile
        self._models: dict[str, LoadedModel] = {}
        self._load_locks: dict[str, threading.Lock] = {}
        self._waiting: list[Request] = []
        self._running: list[Sequence] = []
        self._lock = threading.Condition()
        self._paused = False
        self._stopped = False
        # Called after every decoding step with (the model's key, its busy slots, time.perf_counter()); benchmarks
        # read the steady state from it.
        self.on_step: Callable[[str, int, float], None] | None = None
        # Called after every prefill with (the model's key, the requests it packed, their prompt tokens, its
        # seconds from the forward to the first tokens on the host).
        self.on_prefill: Callable[[str, int, int, float], None] | None = None
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
        if body.choices > loaded.slots.slots:
            raise ServingError(400, f"n is {body.choices}; this worker decodes at most {loaded.slots.slots} "
                               "completions at once (FUSETUNE_SERVING_MAX_BATCH).", "n")  # fmt: skip
        request = Request(loaded, prompt_ids, body, emit)
        max_tokens = min(body.completion_token_limit, loaded.context_tokens - len(prompt_ids))
        base_seed = body.seed if body.seed is not None else secrets.randbits(62)
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        for index in range(body.choices):
            seed = (base_seed * 1_000_003 + index) % (1 << 63)
            decoder = IncrementalDecoder(loaded.tokenizer)
            request.sequences.append(
                Sequence(request, index, seed, temperature, top_p, max_tokens, decoder=decoder)
            )
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
            patch_for_decoding(model)
            eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
            generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            if generation_eos is not None:
                eos |= set(generation_eos if isinstance(generation_eos, list) else [generation_eos])
            context = min(int(getattr(model.config, "max_position_embeddings", None) or 2048), self.max_len)
            slots = SlotBatch(model, self.max_batch, context, self.step_compile)
            loaded = LoadedModel(key, model, tokenizer, eos, context, slots)
            self._warm_prefill(loaded)
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
        for sequence in self._running:
            self._release(sequence)
        self._running, self._waiting = [], []

    def _release(self, sequence: Sequence) -> None:
        if sequence.row is not None:
            sequence.request.loaded.slots.release(sequence.row)
            sequence.row = None

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
        """Prefill waiting requests, in order of arrival, while their model has a free slot for each completion:
        their prompts packed into one row (see `_prefill`), each one's first tokens sampled, its keys and values
        copied into its completions' slots."""
        while self._waiting:
            batch: list[Request] = []
            free_rows: list[int] = []
            tokens = rows = 0  # the batch's prompt tokens, and the slots its completions take
            while self._waiting:
                request = self._waiting[0]
                if request.cancelled.is_set():
                    self._waiting.pop(0)
                    continue
                if batch and (request.loaded is not batch[0].loaded or
                              tokens + len(request.prompt_ids) > self._prefill_tokens):  # fmt: skip
                    break  # the next pass takes it
                if not batch:
                    free_rows = request.loaded.slots.free_rows
                if len(free_rows) < rows + len(request.sequences):
                    break  # it waits for slots; later requests wait behind it
                batch.append(self._waiting.pop(0))
                tokens += len(request.prompt_ids)
                rows += len(request.sequences)
            if not batch:
                return
            loaded = batch[0].loaded
            loaded.last_used = time.monotonic()
            started = time.perf_counter()
            prefilled = self._prefill(loaded, [request.prompt_ids for request in batch])
            # The first tokens on the host (the read waits for the prefill): what the prefill's time ends with.
            firsts = [
                self._draw_first(request.sequences, logits).tolist()
                for request, (logits, _) in zip(batch, prefilled, strict=True)
            ]
            if self.on_prefill is not None:
                self.on_prefill(loaded.key, len(batch), tokens, time.perf_counter() - started)
            for request, (_, layers), first in zip(batch, prefilled, firsts, strict=True):
                sequences = request.sequences
                for sequence, token in zip(sequences, first, strict=True):
                    self._take(sequence, token)
                    if sequence.finish_reason is None:
                        sequence.row = free_rows.pop(0)
                        sampling = (sequence.temperature, sequence.top_p, sequence.seed)
                        loaded.slots.place(sequence.row, sequence, layers, sequence.tokens[-1], sampling)
                        self._running.append(sequence)

    @staticmethod
    def _prefill(
        loaded: LoadedModel, prompts: list[list[int]]
    ) -> list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """One forward over the batch's prompts packed into one row, each prompt its own sequence (its positions
        from 0, attending only to itself: the variable-length attention's packed-sequence keywords, which the
        model's attention takes on a GPU, and a block-diagonal mask for attention that does not); for
        each prompt, the logits after its last token and its keys and values per layer ([1, kv_heads, length,
        head_dim] views of the row's cache).

        Why packed: a prefill is an eager forward, whose time for a short prompt is the host's (launching every
        layer's kernels) more than the device's, and each arriving request had one of its own, between two
        decoding steps: on one H200, of 64 chat requests sent over 2 s, the median waited 1.6 s for its first
        token, and all 64 were decoding within some 20 steps of the first (benchmarks/results/h200-service.json,
        chat-throughput, 2026-12-02): the prefills, one after another, held the steps up. Packed, the requests
        that arrived during one step share the next prefill, whose cost grows with their tokens, not their
        number."""
        from fusetune.models.attention import packed_sequence_kwargs

        lengths = [len(prompt) for prompt in prompts]
        ids = [token for prompt in prompts for token in prompt]
        positions = torch.cat([torch.arange(length) for length in lengths])[None]
        ends = torch.tensor(lengths).cumsum(0)
        device = loaded.device
        mask = None
        if len(prompts) > 1:
            # Block-diagonal and causal, for attention that does not take the packed-sequence keywords (on CPU,
            # float32, a head dim or soft-capping the kernel does not take): transformers derives this mask from
            # packed position ids only without a cache. A sliding-window layer gets it too, so a prompt longer than
            # its window attends beyond it at prefill (the README's serving limits).
            sequence = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lengths)).to(device)
            order = torch.arange(len(ids), device=device)
            mask = (sequence[:, None] == sequence[None, :]) & (order[:, None] >= order[None, :])
            mask = mask[None, None]
        with torch.no_grad():
            output = loaded.model(
                input_ids=torch.tensor([ids], device=device), position_ids=positions.to(device),
                attention_mask=mask, use_cache=True, logits_to_keep=(ends - 1).to(device),
                **packed_sequence_kwargs(positions),
            )  # fmt: skip
        layers = [(layer.keys, layer.values) for layer in output.past_key_values.layers]
        return [
            (
                output.logits[0, i],
                [(k[:, :, end - length : end], v[:, :, end - length : end]) for k, v in layers],
            )
            for i, (length, end) in enumerate(zip(lengths, ends.tolist(), strict=True))
        ]

    def _warm_prefill(self, loaded: LoadedModel) -> None:
        """Prefills of the token counts whose kernels differ, before the model serves: Triton compiles a kernel
        anew for each specialization of its integer arguments (a count that is a multiple of 16 or not), some
        seconds each on a GPU, which the first requests of each kind would otherwise wait for."""
        if loaded.device.type != "cuda":
            return
        for prompts in ([[0] * 16], [[0] * 17], [[0] * 8, [0] * 9]):
            self._prefill(loaded, prompts)
        torch.cuda.synchronize()

    def _step(self) -> None:
        """One token of every running sequence: one decoding step of each model with a busy slot."""
        for sequence in self._running:
            if sequence.request.cancelled.is_set():
                self._release(sequence)
        self._running = [s for s in self._running if s.row is not None]
        models = {s.request.loaded.key: s.request.loaded for s in self._running}
        for loaded in models.values():
            self._decode(loaded)
        self._running = [s for s in self._running if s.finish_reason is None]

    def _decode(self, loaded: LoadedModel) -> None:
        """Take the tokens of the model's step in flight (launching one first if none is), after launching the next.

        The next step goes to the device before this one's tokens are taken (detokenized, streamed, checked for an
        end of turn or a stop string): it needs only the tokens, already on the device, so the host's work per
        token runs while the device computes. A sequence that ends at this step had a row in the next one too: that
        row's token is dropped (it is not the owner's any more), and its key and value went into a slot that is
        free now and is cleared when reused. A request admitted meanwhile (prefilled between two reads) joins the
        step after: its slot's writes are queued behind the step in flight, which computed the free row in vain.
        """
        slots = loaded.slots
        if self._models.get(loaded.key) is not loaded:  # unloaded by a pause while this thread waited
            return
        if slots.in_flight is None:
            slots.in_flight = self._launch(slots)
        tokens, owners = slots.in_flight
        # The wait for the step (one read back for all rows) is made without the lock: a request thread waiting
        # for it would otherwise wait until the engine runs dry, as this thread takes the lock back at once after
        # each step, before a waiter wakes. Whatever changed meanwhile (a request queued, a pause) is seen below.
        self._lock.release()
        try:
            chosen = tokens.tolist()
        finally:
            self._lock.acquire()
        if self._stopped or self._models.get(loaded.key) is not loaded:
            slots.in_flight = None
            return
        slots.in_flight = self._launch(slots)
        live = [(row, s) for row, s in owners if s.row == row and s.finish_reason is None]
        if self.on_step is not None:
            self.on_step(loaded.key, len(live), time.perf_counter())
        for row, sequence in live:
            self._take(sequence, chosen[row])
        loaded.last_used = time.monotonic()

    def _launch(self, slots: SlotBatch) -> tuple[torch.Tensor, list[tuple[int, Sequence]]]:
        """Queue one decoding step of every slot and its sampling; the tokens (on the device, also written as the
        next step's input) and the rows' owners at launch."""
        owners = [(row, owner) for row, owner in enumerate(slots.owners) if owner is not None]
        sampled = [s for _, s in owners if s.temperature != 0]
        with torch.no_grad():
            logits = slots.step()
            if sampled:  # every row at once (a free row draws too; its token is unused)
                cut = any(s.top_p < 1 for s in sampled)
                tokens = sample_rows(logits, slots.temperature, slots.top_p, slots.draws(), cut)
            else:
                tokens = logits.argmax(-1)
                slots.counter.add_(1)
            slots.input_ids[:, 0].copy_(tokens)
        return tokens, owners

    @staticmethod
    def _draw_first(sequences: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The first token (index 0) of each of a request's completions, from its prompt's last logits."""
        first = sequences[0]
        if first.temperature == 0:
            return logits.argmax(-1).expand(len(sequences))
        device = logits.device
        return sample_rows(
            logits.expand(len(sequences), -1),
            torch.full((len(sequences),), first.temperature, device=device),
            torch.full((len(sequences),), first.top_p, device=device),
            uniforms(
                torch.tensor([s.seed for s in sequences], device=device),
                torch.zeros(len(sequences), dtype=torch.long, device=device),
            ),
            cut=first.top_p < 1,
        )

    def _take(self, sequence: Sequence, token: int) -> None:
        """The sequence's next token: tell the request what changed."""
        body = sequence.request.body
        loaded = sequence.request.loaded
        if token in loaded.eos_token_ids:
            self._finish(sequence, "stop", sequence.text + sequence.decoder.rest(sequence.tokens))
            return
        sequence.tokens.append(token)
        # Only what the new token adds is decoded (fusetune/serving/detokenize.py): the text equals the whole
        # list's decoding, less an unfinished character's tokens, which wait.
        text = sequence.text + sequence.decoder.add(sequence.tokens)
        stops = body.stop_sequences
        # A stop string may have begun in text already sent only if it is longer than what came after it.
        search_from = max(0, sequence.sent_chars - max((len(s) for s in stops), default=0))
        found = [at for stop in stops if (at := text.find(stop, search_from)) >= 0]
        if found:
            self._finish(sequence, "stop", text[: min(found)])
            return
        if len(sequence.tokens) >= sequence.max_tokens:
            self._finish(sequence, "length", text + sequence.decoder.rest(sequence.tokens))
            return
        sequence.text = text
        # Held back (besides an unfinished character, not in the text yet): any end of the text that could be the
        # start of a stop string.
        safe = len(text) - max((_overlap(text, stop) for stop in stops), default=0)
        if safe > sequence.sent_chars:
            sequence.request.emit(("delta", sequence.index, text[sequence.sent_chars : safe]))
            sequence.sent_chars = safe

    def _finish(self, sequence: Sequence, reason: str, text: str) -> None:
        request = sequence.request
        if len(text) > sequence.sent_chars:
            request.emit(("delta", sequence.index, text[sequence.sent_chars :]))
        sequence.text, sequence.sent_chars, sequence.finish_reason = text, len(text), reason
        self._release(sequence)
        request.emit(("finish", sequence.index, reason))
        if all(s.finish_reason is not None for s in request.sequences):
            completion_tokens = sum(len(s.tokens) for s in request.sequences)
            request.emit(("usage", len(request.prompt_ids), completion_tokens))
