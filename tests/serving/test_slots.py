"""The serving engine's slot path on CPU: greedy completions equal Hugging Face `generate`'s (greedy, dynamic cache)
on a tiny model in float32, with requests joining while others decode, a slot reused after its sequence ended, a
request waiting for a free slot, and the ring of cache columns wrapping around.

The tiny model is the demo's shape with weights drawn at a larger scale than the demo's (initializer_range 0.2): at
the default scale its greedy completion is one token repeated, which a stale cache column could leave unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from fusetune.demo.assets import TINY_MODEL_SHAPE, build_tiny_model
from fusetune.kernels._interpreter import interpreted
from fusetune.models import attention
from fusetune.serving.engine import Engine
from fusetune.serving.errors import ServingError
from fusetune.spec.chat import ChatCompletionCreate

SLOTS = 2
COLUMNS = 64  # fewer than the steps the test runs, so the write column wraps around the ring
# Each prompt and its completion fit the columns (prompts of 40, 8, 24, 32 and 8 tokens).
PROMPTS = {
    "long": ("Write in digits: two nine, then three four, then one", 20),
    "short": ("hi", 4),
    "joins": ("Write in digits: five", 36),
    "waits": ("what is twelve plus thirty, in digits?", 30),
    "last": ("hi there", 40),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    shape = {**TINY_MODEL_SHAPE, "initializer_range": 0.2}
    return build_tiny_model(tmp_path_factory.mktemp("slots") / "model", shape=shape)


def _load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ), AutoTokenizer.from_pretrained(model_dir)


def _body(content: str, tokens: int, **options) -> ChatCompletionCreate:
    return ChatCompletionCreate(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_completion_tokens=tokens,
        **options,
    )


def _reference(model_dir, content: str, tokens: int) -> list[int]:
    """Hugging Face greedy `generate` over its dynamic cache: the completion's tokens before any end of turn."""
    model, tokenizer = _load(model_dir)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=tokens, do_sample=False)
    completion = output[0, inputs["input_ids"].shape[1] :].tolist()
    eos = {tokenizer.eos_token_id, model.generation_config.eos_token_id}
    return next((completion[:i] for i, token in enumerate(completion) if token in eos), completion)


class _Requests:
    """Submits requests and records what the engine tells each, in the scheduler's thread."""

    def __init__(self, engine: Engine, model_dir):
        self.engine, self.model_dir = engine, model_dir
        self.handles: dict[str, object] = {}
        self.done: dict[str, threading.Event] = {}
        self.events: dict[str, list] = {}
        self.on_usage: dict[str, Callable[[], None]] = {}

    def submit(self, name: str, body: ChatCompletionCreate) -> None:
        self.done[name], self.events[name] = threading.Event(), []

        def emit(event) -> None:
            self.events[name].append(event)
            if event[0] == "usage" and name in self.on_usage:
                self.on_usage[name]()  # in the scheduler's thread, between two steps' bookkeeping
            if event[0] in ("usage", "error"):
                self.done[name].set()

        self.handles[name] = self.engine.submit("tiny", lambda: _load(self.model_dir), body, emit)

    def tokens(self, name: str) -> list[int]:
        assert self.done[name].wait(120), f"{name} did not finish"
        assert self.events[name][-1][0] == "usage", self.events[name][-1]
        return self.handles[name].sequences[0].tokens


def _run_and_compare(engine: Engine, model_dir) -> list[int]:
    """Requests joining while others decode, a slot reused, a request waiting for a free slot, more steps than
    columns; each completion equal to `generate`'s. Returns the busy slots of each step."""
    steps = []
    engine.on_step = lambda key, busy, at: steps.append(busy)
    requests = _Requests(engine, model_dir)
    running_when_joined = []

    def join() -> None:
        # "short" just ended: "long" is mid-way. "joins" takes the slot "short" left; "waits" finds none free and
        # waits until one of the others ends.
        running_when_joined.append(requests.handles["long"].sequences[0].finish_reason is None)
        requests.submit("joins", _body(*PROMPTS["joins"]))
        requests.submit("waits", _body(*PROMPTS["waits"]))

    requests.on_usage["short"] = join
    # One more once "joins" ends, into its slot, so the steps outnumber the columns.
    requests.on_usage["joins"] = lambda: requests.submit("last", _body(*PROMPTS["last"]))
    try:
        # Both admitted in the same pass, whatever the machine's speed: the scheduler admits under the engine's
        # lock (a re-entrant Condition), held here across the two submissions. Submitted one after the other
        # without it, a fast CPU decoded all of "long" before "short" arrived (the GPU host's 16-core Xeon).
        with engine._lock:
            requests.submit("long", _body(*PROMPTS["long"]))
            requests.submit("short", _body(*PROMPTS["short"]))
        got = {name: requests.tokens(name) for name in ("short", "long", "joins", "waits", "last")}
    finally:
        engine.stop()
    assert running_when_joined == [True]
    assert len(steps) > COLUMNS, f"{len(steps)} steps: the ring of {COLUMNS} columns never wrapped"
    assert max(steps) == SLOTS
    for name, (content, tokens) in PROMPTS.items():
        expected = _reference(model_dir, content, tokens)
        assert len(expected) >= 3, f"{name}: the reference ends at once; pick another prompt"
        assert got[name] == expected, name
    return steps


def test_greedy_completions_through_the_slots_equal_generate(model_dir, monkeypatch):
    decode_calls = []
    routed = attention.grouped_query_decode

    def recording(query, key, value, attention_mask, scaling):
        decode_calls.append((tuple(query.shape), tuple(attention_mask.shape), attention_mask.dtype))
        return routed(query, key, value, attention_mask, scaling)

    monkeypatch.setattr(attention, "grouped_query_decode", recording)
    engine = Engine(idle_s=600, max_batch=SLOTS, device=torch.device("cpu"), max_len=COLUMNS)
    steps = _run_and_compare(engine, model_dir)
    # Every decoding step went through the grouped-query decoding path, all slots at once, with a boolean mask over
    # the cache's columns (what the GPU kernel reads).
    layers = TINY_MODEL_SHAPE["num_hidden_layers"]
    heads, dim = TINY_MODEL_SHAPE["num_attention_heads"], TINY_MODEL_SHAPE["hidden_size"] // 4
    # A step is launched before the previous one's tokens are taken, so launches outnumber reads by the times the
    # last running sequence ended (at most once per request).
    assert len(decode_calls) % layers == 0
    assert len(steps) <= len(decode_calls) // layers <= len(steps) + len(PROMPTS)
    assert set(decode_calls) == {((SLOTS, heads, 1, dim), (SLOTS, 1, 1, COLUMNS), torch.bool)}


def test_prompts_arriving_together_are_prefilled_packed_within_the_token_limit(model_dir):
    """ "long" (40 prompt tokens) and "short" (8) are admitted in one pass: packed into one prefill under the CPU's
    limit, and split into two when the limit is below their sum; the completions equal `generate`'s either way
    (each prompt attends only to itself in the packed row)."""
    for limit, first_prefills in ((1024, [(2, 48)]), (45, [(1, 40), (1, 8)])):
        engine = Engine(idle_s=600, max_batch=SLOTS, device=torch.device("cpu"), max_len=COLUMNS)
        engine._prefill_tokens = limit
        prefills: list[tuple[int, int]] = []
        engine.on_prefill = lambda key, requests, tokens, seconds, into=prefills: into.append(
            (requests, tokens)
        )
        _run_and_compare(engine, model_dir)
        assert prefills[: len(first_prefills)] == first_prefills, (limit, prefills)
        assert all(tokens <= limit for _, tokens in prefills), (limit, prefills)


def test_the_compiled_step_is_one_graph_compiled_once_and_gives_the_same_tokens(model_dir):
    """The GPU compiles the step (slots.CUDA_STEP_COMPILE); here Dynamo traces it as the GPU's would, through
    AOTAutograd without Inductor's code generation: in one graph (fullgraph), compiled once for every step of the
    run (a recompilation fails the step), with the completions still equal to `generate`'s."""
    options = {"backend": "aot_eager", "fullgraph": True, "dynamic": False}
    engine = Engine(
        idle_s=600, max_batch=SLOTS, device=torch.device("cpu"), max_len=COLUMNS, step_compile=options
    )
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        _run_and_compare(engine, model_dir)


def test_a_request_longer_than_the_slots_or_with_more_choices_than_slots_is_refused(model_dir):
    engine = Engine(idle_s=600, max_batch=SLOTS, device=torch.device("cpu"), max_len=COLUMNS)
    requests = _Requests(engine, model_dir)
    try:
        with pytest.raises(ServingError, match=f"context is {COLUMNS}") as error:
            requests.submit("too long", _body("nine " * COLUMNS, 4))
        assert error.value.code == "context_length_exceeded"
        with pytest.raises(ServingError, match=f"at most {SLOTS} completions") as error:
            requests.submit("too many", _body("hi", 4, n=SLOTS + 1))
        assert error.value.param == "n"
    finally:
        engine.stop()


@pytest.mark.skipif(
    not interpreted(), reason="the decode kernel runs on CPU tensors only under TRITON_INTERPRET=1"
)
def test_in_bfloat16_the_steps_run_the_decode_attention_kernel_over_the_slots_mask(model_dir, monkeypatch):
    """What a GPU runs: a bfloat16 model's one-token steps reach fusetune's decode-attention kernel (here through
    the Triton interpreter) with every slot's row and the boolean mask over the columns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kernel_calls = []
    kernel = attention.grouped_decode_attention

    def recording(query, key, value, mask, scale):
        kernel_calls.append((tuple(query.shape), query.dtype, tuple(mask.shape), mask.dtype))
        return kernel(query, key, value, mask, scale)

    monkeypatch.setattr(attention, "grouped_decode_attention", recording)

    def load():
        return (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
            AutoTokenizer.from_pretrained(model_dir),
        )

    engine = Engine(idle_s=600, max_batch=SLOTS, device=torch.device("cpu"), max_len=COLUMNS)
    done, events = threading.Event(), []

    def emit(event) -> None:
        events.append(event)
        if event[0] in ("usage", "error"):
            done.set()

    try:
        engine.submit("tiny-bf16", load, _body("hi", 6, n=SLOTS), emit)
        assert done.wait(300)
    finally:
        engine.stop()
    assert events[-1][0] == "usage", events[-1]
    heads, dim = TINY_MODEL_SHAPE["num_attention_heads"], TINY_MODEL_SHAPE["hidden_size"] // 4
    assert kernel_calls, "no decoding step reached the kernel"
    assert set(kernel_calls) == {((SLOTS, heads, 1, dim), torch.bfloat16, (SLOTS, 1, 1, COLUMNS), torch.bool)}


def test_a_seeded_completion_is_the_same_alone_and_beside_another_request(model_dir):
    """Sampled at temperature 1 with top_p 0.9 and a seed: the same tokens alone in row 0, and in row 1 beside a
    request sampled over its whole distribution (whose top_p 1 leaves the step's cut on for one row only)."""

    def body(seed: int, top_p: float) -> ChatCompletionCreate:
        return ChatCompletionCreate(
            model="tiny", messages=[{"role": "user", "content": "hi there"}], temperature=1.0, top_p=top_p,
            seed=seed, max_completion_tokens=12,
        )  # fmt: skip

    runs = []
    for companion in (False, True):
        engine = Engine(idle_s=600, max_batch=SLOTS, device=torch.device("cpu"), max_len=COLUMNS)
        requests = _Requests(engine, model_dir)
        try:
            with engine._lock:  # both admitted in one pass: the companion takes row 0
                if companion:
                    requests.submit("companion", body(9, 1.0))
                requests.submit("seeded", body(5, 0.9))
            runs.append(requests.tokens("seeded"))
            if companion:
                assert requests.tokens("companion") != runs[-1]
        finally:
            engine.stop()
    assert len(runs[0]) >= 3, "the completion ends at once; pick another seed"
    assert runs[0] == runs[1]


def test_each_sampled_token_is_the_draw_keyed_on_the_completions_seed_and_its_index(model_dir):
    """The engine's sampled tokens (the prefill's first, then the slot steps') are sample_rows over the model's
    next-token logits with the uniform of (the completion's seed, the token's index): recomputed here from a plain
    forward over the prompt and the tokens so far."""
    from fusetune.serving.sampling import sample_rows, uniforms

    body = ChatCompletionCreate(
        model="tiny", messages=[{"role": "user", "content": "hi there"}], temperature=0.8, top_p=0.9,
        seed=21, max_completion_tokens=10, n=2,
    )  # fmt: skip
    engine = Engine(idle_s=600, max_batch=SLOTS, device=torch.device("cpu"), max_len=COLUMNS)
    requests = _Requests(engine, model_dir)
    try:
        requests.submit("seeded", body)
        requests.tokens("seeded")
    finally:
        engine.stop()
    model, tokenizer = _load(model_dir)
    prompt = requests.handles["seeded"].prompt_ids
    eos = {tokenizer.eos_token_id, model.generation_config.eos_token_id}
    completions = []
    for sequence in requests.handles["seeded"].sequences:
        expected: list[int] = []
        while len(expected) < 10:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + expected])).logits[:, -1]
            u = uniforms(torch.tensor([sequence.seed]), torch.tensor([len(expected)]))
            token = int(sample_rows(logits, torch.tensor([0.8]), torch.tensor([0.9]), u)[0])
            if token in eos:
                break
            expected.append(token)
        assert sequence.tokens == expected
        completions.append(expected)
    assert completions[0] != completions[1]  # the two completions have seeds of their own
