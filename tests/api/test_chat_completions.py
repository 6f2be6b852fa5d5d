"""Chat completions through the unmodified `openai` SDK against a running service (`fusetune serve`: the API, its
embedded worker and the worker's chat completions server), on the bundled tiny model and on a LoRA fine-tuned
model of it.

The fields are checked here besides what the SDK's own types parse; every body and stream event is checked against
OpenAI's spec in tests/api/test_openai_conformance.py.
"""

from __future__ import annotations

import json
import time

import openai
import pytest
import torch

from fusetune.catalog import fine_tuned_model_name
from fusetune.db import queries
from fusetune.db.models import DEFAULT_TENANT, Job, JobStatus
from fusetune.db.session import make_engine, make_session_factory
from fusetune.demo.assets import TRAIN_FILE, build_tiny_model
from tests.services import running_service

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Write in digits: two nine"}]


def _lora_checkpoint(base_dir, target) -> None:
    """A LoRA job's checkpoint as the trainer writes it: the adapter (non-zero, so the merge changes the model)
    naming its base by public name, and the tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        adapted = get_peft_model(base, config)
        # The random model's next-token distributions are near uniform: an adapter of the usual scale would leave
        # a seeded draw unchanged. This one moves them.
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.data.mul_(100)
        adapted.save_pretrained(target)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(target)
    adapter_config = target / "adapter_config.json"
    adapter_config.write_text(
        json.dumps({**json.loads(adapter_config.read_text()), "base_model_name_or_path": MODEL})
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("chat") / "data"
    build_tiny_model(data_dir / "models" / MODEL)
    with running_service(data_dir) as service:
        yield service


@pytest.fixture(scope="module")
def fine_tuned(service) -> tuple[str, str]:
    """(a LoRA fine-tuned model of the default tenant, another tenant's key): the job's rows as the worker
    records a success, and its checkpoint in the runs folder."""
    settings = service.settings
    upload = service.upload(TRAIN_FILE)
    assert upload.status_code == 200, upload.text
    with make_session_factory(make_engine(settings.database_url))() as session:
        job = Job(
            tenant=DEFAULT_TENANT,
            model=MODEL,
            training_file_id=upload.json()["id"],
            status=JobStatus.SUCCEEDED,
        )
        session.add(job)
        session.flush()
        job.fine_tuned_model = fine_tuned_model_name(MODEL, DEFAULT_TENANT, "chat", job.id)
        job.finished_at = 1
        queries.add_checkpoint(session, job.id, 1, f"{job.id}/checkpoint-1", {})
        _, other_key = queries.create_api_key(session, "other")
        session.commit()
        name = job.fine_tuned_model
        _lora_checkpoint(settings.models_dir / MODEL, settings.runs_dir / job.id / "checkpoint-1")
    return name, other_key


@pytest.fixture(scope="module")
def client(service) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=service.api_key, max_retries=0)
    # The worker advertises its chat completions server on its first heartbeat, once it has started.
    while True:
        try:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=1)
            return client
        except openai.InternalServerError as error:
            assert error.body["code"] == "no_serving_worker", error.body
            time.sleep(0.3)


def _check_completion(completion, n: int = 1, model: str = MODEL) -> None:
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == model and completion.created > 0
    assert [choice.index for choice in completion.choices] == list(range(n))
    for choice in completion.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_streamed_completion_is_the_completion_for_the_same_seed(client):
    request = dict(model=MODEL, messages=HELLO, seed=7, max_completion_tokens=12, temperature=0.9, top_p=0.95)
    completion = client.chat.completions.create(**request)
    _check_completion(completion)
    assert completion.usage.completion_tokens <= 12
    chunks = list(client.chat.completions.create(**request, stream=True))  # the SDK ends at data: [DONE]
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == completion.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == completion.choices[0].finish_reason
    # Another seed, another completion (12 tokens of a random model's 500: alike only by a fluke).
    other = client.chat.completions.create(**{**request, "seed": 8})
    assert other.choices[0].message.content != completion.choices[0].message.content


def test_usage_in_the_stream_and_done_at_its_end(service):
    body = {"model": MODEL, "messages": HELLO, "seed": 1, "max_completion_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with service.client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/event-stream"
        )
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"]["completion_tokens"] <= 4


def test_n_completions(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, n=2, seed=3, max_completion_tokens=6
    )
    _check_completion(completion, n=2)
    assert completion.choices[0].message.content != completion.choices[1].message.content


def test_token_limit_and_stop_strings(client):
    greedy = dict(model=MODEL, messages=HELLO, temperature=0, max_completion_tokens=10)
    limited = client.chat.completions.create(**greedy)
    assert limited.choices[0].finish_reason == "length" and limited.usage.completion_tokens == 10
    text = limited.choices[0].message.content
    assert len(text) >= 2
    stop = text[len(text) // 2]
    stopped = client.chat.completions.create(**greedy, stop=[stop, "never in it \u2603"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    # The older max_tokens is a limit too.
    assert (
        client.chat.completions.create(
            **{**greedy, "max_completion_tokens": None}, max_tokens=3
        ).usage.completion_tokens
        == 3
    )


def test_a_fine_tuned_model_of_its_tenant_only(client, service, fine_tuned):
    model, other_key = fine_tuned
    completion = client.chat.completions.create(model=model, messages=HELLO, seed=2, max_completion_tokens=5)
    _check_completion(completion, model=model)
    base = client.chat.completions.create(model=MODEL, messages=HELLO, seed=2, max_completion_tokens=5)
    assert completion.choices[0].message.content != base.choices[0].message.content  # the adapter was merged
    other = openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=other_key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as error:
        other.chat.completions.create(model=model, messages=HELLO)
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"
    assert other.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=2).choices
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HELLO)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logprobs": True}, "logprobs"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages.0"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_fields_are_a_400_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": MODEL, "messages": HELLO, **fields})
    assert error.value.body["param"].startswith(param), error.value.body
    assert error.value.body["type"] == "invalid_request_error"
