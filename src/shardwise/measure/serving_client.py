"""HTTP to one OpenAI-compatible server for ``serving_bench``: httpx with a timeout on every call,
every failure one ``ShardwiseError`` line (unreachable, not OpenAI-compatible, an HTTP error status,
no answer in time), and streamed requests timed chunk by chunk (``Timing``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from shardwise.errors import ShardwiseError

CONNECT_TIMEOUT_S = 10.0
PROBE_TEXT = "Hello world. The quick brown fox jumps over the lazy dog."


def check_url(url: str) -> str:
    """The base URL without a trailing slash; http(s)://HOST[:PORT][/PATH] or a one-line error."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ShardwiseError(f"--url '{url}' must look like http://HOST:PORT/v1")
    try:
        parts.port
    except ValueError:
        raise ShardwiseError(f"--url '{url}' has a bad port") from None
    return url.rstrip("/")


@dataclass(frozen=True)
class ServingConfig:
    url: str
    model: str | None = None
    pp: int = 2048
    tg: int = 128
    depths: tuple[int, ...] = (0,)
    concurrency: tuple[int, ...] = (1,)
    runs: int = 3
    endpoint: str = "completions"
    timeout_s: float = 300.0
    api_key: str | None = None


class ServerError(ShardwiseError):
    """The server answered an HTTP error status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Timing:
    """One streamed request: when it was sent, its first chunk, each chunk with a token, and usage."""

    sent: float
    first_response: float | None = None
    token_times: tuple[float, ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


class Server:
    """HTTP to one OpenAI-compatible server (httpx, a timeout on every call, one-line errors)."""

    def __init__(self, cfg: ServingConfig, connections: int = 8):
        import httpx

        self.cfg, self.httpx = cfg, httpx
        self.url = check_url(cfg.url)
        self.root = self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.client = httpx.Client(
            timeout=httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, CONNECT_TIMEOUT_S)), headers=headers,
            limits=httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4),
        )
        self.model = cfg.model or ""
        self.extras: dict = {}
        self.path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ HTTP with one-line errors
    def _failure(self, exc: Exception, what: str) -> ShardwiseError:
        httpx = self.httpx
        if isinstance(exc, httpx.ConnectTimeout):
            return ShardwiseError(f"cannot reach {self.url}: no connection within {CONNECT_TIMEOUT_S:g} s")
        if isinstance(exc, httpx.ConnectError):
            reason = str(exc).split("] ")[-1] or type(exc).__name__
            return ShardwiseError(f"cannot reach {self.url}: {reason}")
        if isinstance(exc, httpx.TimeoutException):
            return ShardwiseError(f"{self.url} did not answer {what} within {self.cfg.timeout_s:g} s (--timeout)")
        return ShardwiseError(f"{self.url}: {what} failed ({type(exc).__name__}: {exc})")

    def _status(self, response, what: str) -> None:
        if response.status_code < 400:
            return
        try:
            body = response.json()
            err = body.get("error", body) if isinstance(body, dict) else body
            message = err.get("message", err.get("detail", err)) if isinstance(err, dict) else err
        except ValueError:
            message = response.text
        message = " ".join(str(message).split())[:300]
        raise ServerError(response.status_code, f"{self.url}: {what} answered HTTP {response.status_code}: {message}")

    def call(self, method: str, url: str, what: str, body: dict | None = None, timeout: float | None = None):
        """JSON of ``method url`` (errors: one ShardwiseError line; ServerError for a status >= 400)."""
        try:
            response = self.client.request(method, url, json=body, timeout=timeout or self.httpx.USE_CLIENT_DEFAULT)
        except self.httpx.HTTPError as exc:
            raise self._failure(exc, what) from None
        self._status(response, what)
        try:
            return response.json()
        except ValueError:
            raise ShardwiseError(f"{self.url} is not an OpenAI-compatible server: {what} did not answer JSON "
                                 f"({response.headers.get('content-type', 'no content type')})") from None

    def models(self) -> list[str]:
        """The served model ids (``GET /models``)."""
        what = "GET /models"
        try:
            doc = self.call("GET", self.url + "/models", what, timeout=min(self.cfg.timeout_s, CONNECT_TIMEOUT_S))
        except ServerError as exc:
            raise ShardwiseError(f"{self.url} is not an OpenAI-compatible server: {what} answered HTTP {exc.status}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
            raise ShardwiseError(f"{self.url} is not an OpenAI-compatible server: {what} has no 'data' list")
        return [str(m.get("id")) for m in doc["data"] if isinstance(m, dict)]

    # ------------------------------------------------------------------ requests
    def body(self, text: str, max_tokens: int, stream: bool) -> dict:
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
        if self.cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if stream:
            body.update(self.extras)
        elif "ignore_eos" in self.extras:
            body["ignore_eos"] = True
        return body

    def usage_tokens(self, text: str, required: bool = True) -> int | None:
        """``usage.prompt_tokens`` of a ``max_tokens=1`` request with ``text`` (None when the server
        reports none and not ``required``)."""
        doc = self.call("POST", self.url + self.path, f"POST {self.path}", self.body(text, 1, stream=False))
        tokens = (doc.get("usage") or {}).get("prompt_tokens") if isinstance(doc, dict) else None
        if isinstance(tokens, int):
            return tokens
        if required:
            raise ShardwiseError(f"{self.url}: POST {self.path} reports no usage.prompt_tokens, and the server "
                                 "has no tokenize endpoint: prompt lengths cannot be counted")
        return None

    def stream(self, text: str, max_tokens: int) -> Timing:
        """Stream one request; times of its first chunk and of each chunk that carries a token."""
        what = f"POST {self.path} (stream)"
        body = self.body(text, max_tokens, stream=True)
        deadline = time.perf_counter() + self.cfg.timeout_s
        timing = Timing(sent=time.perf_counter())
        times: list[float] = []
        try:
            with self.client.stream("POST", self.url + self.path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    self._status(response, what)
                for line in response.iter_lines():
                    now = time.perf_counter()
                    if now > deadline:
                        raise ShardwiseError(f"{self.url}: {what} took more than {self.cfg.timeout_s:g} s (--timeout)")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = _json(data, self.url, what)
                    timing.first_response = timing.first_response or now
                    if chunk.get("error"):
                        raise ShardwiseError(f"{self.url}: {what} streamed an error: {chunk['error']}")
                    usage = chunk.get("usage") or {}
                    timing.prompt_tokens = usage.get("prompt_tokens", timing.prompt_tokens)
                    timing.completion_tokens = usage.get("completion_tokens", timing.completion_tokens)
                    for choice in chunk.get("choices") or ():
                        if _is_token(choice):
                            times.append(now)
                        timing.finish_reason = choice.get("finish_reason") or timing.finish_reason
        except self.httpx.HTTPError as exc:
            raise self._failure(exc, what) from None
        timing.token_times = tuple(times)
        return timing


def _is_token(choice: dict) -> bool:
    """Whether a streamed choice carries a generated token: its text (completions) or its delta's
    content (chat), even empty (a server holds back the bytes of an unfinished UTF-8 character), but
    not a chat role announcement nor an empty closing chunk."""
    finish = choice.get("finish_reason")
    if "delta" in choice:
        delta = choice.get("delta") or {}
        text = delta.get("content") if delta.get("content") is not None else delta.get("reasoning_content")
        return isinstance(text, str) and (text != "" or ("role" not in delta and not finish))
    text = choice.get("text")
    return isinstance(text, str) and (text != "" or not finish)


def _json(data: str, url: str, what: str) -> dict:
    try:
        chunk = json.loads(data)
    except ValueError:
        chunk = None
    if not isinstance(chunk, dict):
        raise ShardwiseError(f"{url} is not an OpenAI-compatible server: {what} streamed a chunk that is not a JSON object")
    return chunk
