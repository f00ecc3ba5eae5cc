"""The HTTP side (Starlette on uvicorn, on a thread of rank 0): OpenAI routes, SSE, health,
metrics and the chat page.

A generation request is parsed (``protocol``), handed to the engine, and answered from a
per-request ``asyncio.Queue`` the engine's thread fills with ``("delta", text)``, ``("done",
finish, usage)`` or ``("error", status, message)`` events. A client that disconnects (a closed
stream, or a dropped connection while a non-streamed answer is pending) is cancelled at once,
which frees its slot at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from shardwise.serve import protocol
from shardwise.serve.protocol import GenRequest, Limits, RequestError, error_body
from shardwise.serve.scheduler import Seq
from shardwise.serve.text import TextStream


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param), status_code=status)


def _sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def build_app(engine, tokenizer, limits: Limits, metrics) -> Starlette:
    """The Starlette app of one server."""
    page = resources.files("shardwise.serve").joinpath("chat.html").read_text(encoding="utf-8")

    async def health(request: Request) -> Response:
        healthy, reason = engine.health()
        if healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": engine.state, "reason": reason}, status_code=503)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": limits.model_name, "object": "model", "created": 0, "owned_by": "shardwise",
            "max_model_len": limits.max_model_len,
        }]})

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat_page(request: Request) -> Response:
        return HTMLResponse(page)

    async def generate(request: Request, endpoint: str) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            metrics.requests.labels(endpoint, "rejected").inc()
            return _error(400, "the request body is not valid JSON")
        try:
            parse = protocol.parse_chat if endpoint == "chat" else protocol.parse_completion
            req = parse(body, tokenizer, limits)
        except RequestError as exc:
            metrics.requests.labels(endpoint, "rejected").inc()
            return JSONResponse(exc.body(), status_code=exc.status)
        if not engine.accepting():
            metrics.requests.labels(endpoint, "rejected").inc()
            return _error(503, f"the server is not accepting requests: {engine.reason}", "service_unavailable")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        seq = Seq(req, TextStream(tokenizer, req.stop), lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        engine.submit(seq)
        if req.stream:
            return StreamingResponse(_stream(req, seq, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, req, seq, events)

    async def _whole(request: Request, req: GenRequest, seq: Seq, events: asyncio.Queue) -> Response:
        watcher = asyncio.create_task(_disconnected(request))
        text: list[str] = []
        try:
            while True:
                getter = asyncio.create_task(events.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    engine.cancel(seq)
                    return Response(status_code=499)
                event = getter.result()
                if event[0] == "delta":
                    text.append(event[1])
                elif event[0] == "done":
                    return JSONResponse(protocol.completion(req, limits.model_name, "".join(text), event[1],
                                                            event[2]["completion_tokens"]))
                else:
                    return _error(event[1], event[2], "service_unavailable")
        finally:
            watcher.cancel()

    async def _stream(req: GenRequest, seq: Seq, events: asyncio.Queue):
        model, finished = limits.model_name, False
        try:
            if req.kind == "chat":  # the opening chunk carries the assistant role
                yield _sse(protocol.chunk(req, model, None, None, first=True))
            while True:
                event = await events.get()
                if event[0] == "delta":
                    yield _sse(protocol.chunk(req, model, event[1], None))
                elif event[0] == "done":
                    finished = True
                    yield _sse(protocol.chunk(req, model, None, event[1]))
                    if req.include_usage:
                        u = event[2]
                        yield _sse(protocol.usage_chunk(req, model, u["prompt_tokens"], u["completion_tokens"]))
                    yield _sse("[DONE]")
                    return
                else:
                    finished = True
                    yield _sse(error_body(event[2], "service_unavailable"))
                    return
        finally:
            if not finished:  # the client went away (Starlette cancels this generator) or the send failed
                engine.cancel(seq)

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "text")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                      "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    async def internal_error(request: Request, exc: Exception) -> Response:
        return _error(500, f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      "server_error")

    routes = [
        Route("/", chat_page), Route("/health", health), Route("/metrics", metrics_route),
        Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: internal_error})


async def _disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body is read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
