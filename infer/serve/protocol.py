"""The OpenAI request bodies the server accepts (pydantic: a malformed body is a 400 naming the
field) and the response pieces it writes: completion objects, streamed chunks, usage and
OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`).

Fields OpenAI defines that the server does not act on are refused rather than ignored
(`tools`, `logit_bias`): a client must not believe it got what it asked for. Unknown extra
fields are ignored, as OpenAI's own server does.
"""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infer.engine import MAX_LOGPROBS


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """What chat and completions requests share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**31), lt=2**31)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's names for the other constraints (the openai client sends them as extra_body).
    guided_regex: str | None = None
    guided_grammar: str | None = None  # a Lark grammar
    # Defined by OpenAI, not done here: refused with a message if set.
    tools: Any = None
    logit_bias: Any = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def alternatives(self) -> int | None:
        """How many most likely tokens to report per token with its log-probability (None: no
        log-probabilities); a ValueError says what is inconsistent."""
        raise NotImplementedError

    def refused(self) -> str | None:
        """The first field set that the server does not implement, if any."""
        for name in ("tools", "logit_bias"):
            if getattr(self, name) not in (None, False, [], {}):
                return name
        return None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    def alternatives(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError(
                f"top_logprobs={self.top_logprobs} needs logprobs: true (log-probabilities of "
                "the generated tokens, which top_logprobs adds alternatives to)"
            )
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    def alternatives(self) -> int | None:
        return self.logprobs


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
