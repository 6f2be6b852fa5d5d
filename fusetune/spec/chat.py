"""A chat completion request, as OpenAI's `POST /v1/chat/completions` takes it: the API validates it and the
worker's serving engine (fusetune.serving) runs it, so both read it from here.

Fields OpenAI has and fusetune does not serve (tools, logprobs, response_format, penalties, ...) are refused with
a 400 naming the field rather than ignored: a client relying on one would get a reply that silently lacks it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# A completion without max_completion_tokens (or max_tokens) stops at this many tokens, or at the end of the
# model's context if that comes first.
DEFAULT_MAX_COMPLETION_TOKENS = 1024
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_CHOICES = 128  # OpenAI's limit on n
# The API forwards a checked request to a worker's serving server with the caller's tenant in this header.
TENANT_HEADER = "X-Fusetune-Tenant"


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # OpenAI's `developer` is a system message for a model whose template knows no developer role.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_message(self) -> dict[str, str]:
        """The message as a chat template reads it: a role it knows and the content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None


class ChatCompletionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI for max_completion_tokens")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy; default 1")
    top_p: float | None = Field(None, ge=0, le=1, description="default 1")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they change nothing of the reply.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        if any(not stop for stop in stops):
            raise ValueError("a stop sequence may not be empty")
        return value

    @property
    def stop_sequences(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def completion_token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_COMPLETION_TOKENS

    @property
    def choices(self) -> int:
        return self.n or 1

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.template_message() for message in self.messages]
