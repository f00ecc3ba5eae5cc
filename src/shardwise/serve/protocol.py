"""The OpenAI wire format: request bodies parsed into ``GenRequest``s, responses and SSE chunks.

Validation happens here, before anything reaches the scheduler: a body that the server
cannot honour exactly gets a ``RequestError`` (HTTP 4xx, an OpenAI-shaped error JSON whose
``param`` names the field) — never a silently different answer. Unknown fields that change
nothing (``user``, ``metadata``) are ignored; fields that would change the output and are not
implemented (``n`` > 1, tools, logprobs, penalties, logit bias, JSON mode) are refused.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 4
"""Stop strings per request (OpenAI's limit)."""

UNSUPPORTED = {
    "tools": None, "tool_choice": None, "functions": None, "function_call": None, "logit_bias": None,
    "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "audio": None, "modalities": (None, ["text"]), "prediction": None,
}
"""Fields refused unless they hold one of the listed neutral values (None alone: any value is refused)."""


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, one-line ``message``, the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error JSON."""
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class GenRequest:
    """One generation: prompt ids, limits and sampling, and how to answer (chat or text, streamed)."""

    kind: str  # "chat" or "text"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        self.id = self.id or prefix + uuid.uuid4().hex[:24]
        self.created = self.created or int(time.time())


@dataclass(frozen=True)
class Limits:
    """What the loaded model can take: vocabulary (ids), cache slot length (tokens), served name."""

    vocab_size: int
    max_model_len: int
    model_name: str


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise RequestError(f"'{name}' must be between {low:g} and {high:g}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {value!r}", name)
    return value


def _check_unsupported(body: dict) -> None:
    for name, neutral in UNSUPPORTED.items():
        if name not in body:
            continue
        value = body[name]
        allowed = neutral if isinstance(neutral, tuple) else (None,)
        if value not in allowed or (name == "modalities" and value not in (None, ["text"])):
            raise RequestError(f"'{name}' is not supported by this server: remove it", name)
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError(f"'n' must be 1 (one choice per request), got {n!r}", "n")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise RequestError("'response_format' other than text is not supported: remove it", "response_format")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
    return stops


def _common(body: Any, limits: Limits) -> dict[str, Any]:
    """The fields chat and text completions share, checked."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise RequestError(f"the model '{model}' does not exist: this server serves '{limits.model_name}'",
                           "model", 404, code="model_not_found")
    _check_unsupported(body)
    stream = body.get("stream", False)
    if stream not in (True, False, None):
        raise RequestError(f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or options.get("include_usage", False) not in (True, False, None):
        raise RequestError("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    seed = _integer(body, "seed")
    ignore_eos = body.get("ignore_eos", False)
    if ignore_eos not in (True, False, None):
        raise RequestError(f"'ignore_eos' must be true or false, got {ignore_eos!r}", "ignore_eos")
    return {
        "ignore_eos": bool(ignore_eos),
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        "seed": seed,
        "stop": _stop(body),
        "stream": bool(stream),
        "include_usage": bool(options.get("include_usage", False)),
    }


def _max_tokens(body: dict, names: tuple[str, ...], prompt_len: int, limits: Limits, prompt_param: str) -> int:
    """The generation limit: the first of ``names`` the body sets, or what is left of the cache slot."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"the prompt has {prompt_len} tokens; this server's --max-model-len is {limits.max_model_len}, "
            "which leaves no room to generate: shorten the prompt", prompt_param,
        )
    name = next((n for n in names if body.get(n) is not None), names[0])
    asked = _integer(body, name)
    if asked is None:
        return room
    if asked < 1:
        raise RequestError(f"'{name}' must be at least 1, got {asked}", name)
    if asked > room:
        raise RequestError(
            f"'{name}' {asked} + the prompt's {prompt_len} tokens exceed this server's --max-model-len "
            f"{limits.max_model_len}: ask for at most {room} tokens", name,
        )
    return asked


def _check_ids(ids: list[int], limits: Limits, param: str) -> list[int]:
    if not ids:
        raise RequestError("the prompt is empty: send at least one token", param)
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad!r} is outside the vocabulary 0..{limits.vocab_size - 1}", param)
    return ids


def parse_chat(body: Any, tokenizer, limits: Limits) -> GenRequest:
    """A ``/v1/chat/completions`` body → GenRequest (messages rendered by the checkpoint's chat template)."""
    common = _common(body, limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise RequestError(f"messages[{i}] must have a role of system, user or assistant", f"messages[{i}].role")
        content = m.get("content")
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        )
        if not isinstance(content, str) and not parts_ok:
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts",
                               f"messages[{i}].content")
    ids = _check_ids(tokenizer.chat_ids(messages), limits, "messages")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), len(ids), limits, "messages")
    return GenRequest("chat", ids, max_tokens, **common)


def parse_completion(body: Any, tokenizer, limits: Limits) -> GenRequest:
    """A ``/v1/completions`` body → GenRequest; the prompt is text, or a list of token ids."""
    common = _common(body, limits)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list):
        raise RequestError("'prompt' holds several prompts: send one prompt per request", "prompt")
    else:
        raise RequestError("'prompt' must be a string or a list of token ids", "prompt")
    ids = _check_ids(ids, limits, "prompt")
    return GenRequest("text", ids, _max_tokens(body, ("max_tokens",), len(ids), limits, "prompt"), **common)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chunk(req: GenRequest, model: str, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": req.id, "object": "chat.completion.chunk", "created": req.created, "model": model,
                "choices": [choice]}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": req.id, "object": "text_completion", "created": req.created, "model": model, "choices": [choice]}


def usage_chunk(req: GenRequest, model: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    body = chunk(req, model, None, None)
    body["choices"] = []
    body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def completion(req: GenRequest, model: str, text: str, finish: str, completion_tokens: int) -> dict[str, Any]:
    """The whole (non-streamed) response."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": model, "choices": [choice],
            "usage": usage(len(req.prompt_ids), completion_tokens)}
