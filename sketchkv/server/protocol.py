"""OpenAI API shapes: pydantic request models (strict types: "5" is not an int) and response builders.

Unknown fields are ignored, like OpenAI's own server does for fields it does not know. A few vLLM
extensions are accepted (top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, return_tokens_as_token_ids); fields sketchkv cannot honour are refused with 400 when set to anything
but their neutral value, never silently dropped.
"""
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests ------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    return_tokens_as_token_ids: bool | None = None     # logprobs tokens as "token_id:123"


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)     # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")   # tool_calls, name, ... go to the template
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages for the chat template, text content parts joined into one string."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"content part type {part.type!r} is not supported (text only)",
                                   f"messages.{i}.content.{j}.type")
                texts.append(part.text)
            d["content"] = "".join(texts)
        elif m.content is None:
            d["content"] = ""
        out.append(d)
    return out


def unsupported(req: _Sampling) -> None:
    """400 for knobs sketchkv cannot honour (set to a non-neutral value)."""
    if req.n not in (None, 1):
        raise ApiError(400, "only n=1 is supported", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if req.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", "best_of")
        if req.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
    if isinstance(req, ChatCompletionRequest):
        if req.tools:
            raise ApiError(400, "tools are not supported yet", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ApiError(400, "response_format other than text is not supported", "response_format")
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")


# ---- responses -----------------------------------------------------------------------------------
def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def completion_logprobs(token_strs: list[str], logprobs: list[float],
                        top: list[list[tuple[str, float]]] | None, offset: int) -> dict:
    """Legacy completions `logprobs` object; text_offset counts from `offset` (the prompt text's length)."""
    offsets = []
    for s in token_strs:
        offsets.append(offset)
        offset += len(s)
    tops = None
    if top is not None:  # most likely first; the likelier one wins when two ids decode to the same string
        tops = []
        for row in top:
            d: dict[str, float] = {}
            for t, lp in row:
                d.setdefault(t, lp)
            tops.append(d)
    return {"tokens": token_strs, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokens: list[tuple[str, bytes]], logprobs: list[float],
                  top: list[list[tuple[tuple[str, bytes], float]]] | None) -> dict:
    """Chat `logprobs`: tokens as (decoded string, raw bytes) pairs."""
    def entry(tok: tuple[str, bytes], lp: float) -> dict:
        return {"token": tok[0], "logprob": lp, "bytes": list(tok[1])}
    content = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        e = entry(tok, lp)
        e["top_logprobs"] = [entry(t, v) for t, v in top[i]] if top is not None else []
        content.append(e)
    return {"content": content, "refusal": None}


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                        logprobs: dict | None, usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage_, "system_fingerprint": None}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     logprobs: dict | None, include_usage: bool) -> dict:
    d = {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        d["usage"] = None
    return d


def chat_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                  logprobs: dict | None, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                 "tool_calls": []},
                         "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage_, "system_fingerprint": None}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None, include_usage: bool) -> dict:
    d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
         "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        d["usage"] = None
    return d


def usage_chunk(rid: str, model: str, created: int, obj: Literal["text_completion", "chat.completion.chunk"],
                usage_: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


def models_response(name: str, max_model_len: int | None, created: int) -> dict:
    return {"object": "list", "data": [model_card(name, max_model_len, created)]}


def model_card(name: str, max_model_len: int | None, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "sketchkv", "root": name,
            "max_model_len": max_model_len}


def now() -> int:
    return int(time.time())
