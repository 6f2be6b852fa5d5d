"""The demo dataset and tiny model: deterministic, loadable offline, with a chat template that marks the
assistant's tokens."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fusetune.demo import assets


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_bundled_files_match_the_generator(tmp_path):
    train, valid = assets.write_bundled_datasets(tmp_path)
    assert train.read_bytes() == assets.TRAIN_FILE.read_bytes()
    assert valid.read_bytes() == assets.VALID_FILE.read_bytes()


def test_bundled_validation_questions_are_not_in_training_set():
    def questions(path):
        return {json.loads(line)["messages"][1]["content"] for line in path.read_text().splitlines()}

    train, valid = questions(assets.TRAIN_FILE), questions(assets.VALID_FILE)
    assert len(train) == assets.BUNDLED_TRAIN_EXAMPLES
    assert len(valid) == assets.BUNDLED_VALID_EXAMPLES
    assert not train & valid


def test_demo_answers_are_correct(tmp_path):
    path = assets.write_demo_dataset(tmp_path / "d.jsonl", n_examples=200, seed=3)
    for line in path.read_text().splitlines():
        system, user, assistant = json.loads(line)["messages"]
        assert (system["role"], user["role"], assistant["role"]) == ("system", "user", "assistant")
        question, answer = user["content"], assistant["content"]
        if question.startswith("What is "):
            a, op, b = question.removeprefix("What is ").removesuffix("?").split()
            assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        else:
            word = question.removeprefix("Reverse the word: ")
            assert answer == word[::-1]


def test_demo_dataset_is_deterministic(tmp_path):
    a = assets.write_demo_dataset(tmp_path / "a.jsonl", n_examples=50, seed=7).read_bytes()
    b = assets.write_demo_dataset(tmp_path / "b.jsonl", n_examples=50, seed=7).read_bytes()
    c = assets.write_demo_dataset(tmp_path / "c.jsonl", n_examples=50, seed=8).read_bytes()
    assert a == b
    assert a != c


def test_tiny_model_loads_offline_with_auto_classes(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "llama"
    assert model.config.hidden_size == assets.TINY_MODEL_SHAPE["hidden_size"]
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    text = "What is 17 + 25?"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    logits = model(**tokenizer(text, return_tensors="pt")).logits
    assert logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(logits).all()


def test_tiny_model_is_deterministic_per_seed(tmp_path, tiny_model_dir):
    again = assets.build_tiny_model(tmp_path / "again", seed=0)
    other = assets.build_tiny_model(tmp_path / "other", seed=1)
    same_weights = (tiny_model_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == same_weights
    assert (again / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != same_weights


def test_build_tiny_model_of_another_family(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        assets.build_tiny_model(tmp_path / "qwen", model_type="qwen2")
    )
    assert model.config.model_type == "qwen2"


def test_chat_template_masks_everything_but_the_assistant_reply(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 17 + 25?"},
        {"role": "assistant", "content": "42"},
    ]
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert ids[0] == tokenizer.bos_token_id
    trained = [token for token, keep in zip(ids, mask, strict=True) if keep]
    assert tokenizer.decode(trained) == "42" + tokenizer.eos_token
    # Everything before the reply, the prompt and role markers included, is masked out.
    first_trained = mask.index(1)
    assert not any(mask[:first_trained])
    assert tokenizer.decode(ids[:first_trained]).endswith("<|assistant|>\n")
    prompt_ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, return_dict=True)
    assert ids[:first_trained] == prompt_ids["input_ids"]
