"""What each process of ``shardwise serve`` runs: ``serve_rank(rank, world_size, request)``.

Rank 0 starts the HTTP server first (``/health`` answers 503 "loading" while the shard loads),
then loads its shard and drives the engine on its main thread until SIGTERM/SIGINT (drain,
then exit 0) or a failure (every in-flight request gets an error, then the rank raises and the
launcher stops the others). The other ranks load their shard and follow rank 0's steps; they
ignore SIGINT (a Ctrl-C reaches the whole process group) and stop when rank 0 says so. Under
``launch_local`` or ``torchrun`` rank 0 also hears when a peer died or froze
(``peer_watch.on_peer_failure``) and fails its requests before it exits.
"""

from __future__ import annotations

import signal
from functools import partial
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.errors import ShardwiseError

STARTUP_S = 30.0
"""Seconds the HTTP server may take to bind before the server gives up."""


@dataclass(frozen=True)
class ServeRequest:
    """Everything a rank needs; picklable so it crosses to the rank processes."""

    checkpoint: str
    model_name: str
    tp: int = 1
    ep: int = 1
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_model_len: int = 2048
    prefill_chunk: int = 128
    allreduce: str = "builtin"
    backend: str = "gloo"
    spec_tokens: int = 0  # prompt-lookup drafts per verify pass for a greedy sequence alone (0: off)
    ngram_min: int = 1
    ngram_max: int = 3
    int_activations: str | None = None  # rows 4-bit weights multiply (int_matmul.activations); None: the environment's


def load_model(rank: int, request: ServeRequest):
    """This rank's loaded shard with ``max_batch`` cache slots of ``max_model_len`` positions."""
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.layers import set_allreduce
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.int_matmul import set_activations
    from shardwise.runtime.model import ShardedCausalLM

    if request.int_activations is not None:
        set_activations(request.int_activations)
    if request.backend == "nccl":
        from shardwise.runtime.rendezvous import RankContext

        torch.set_default_device(RankContext.current().device)
    set_allreduce(request.allreduce)
    spec = load_spec(request.checkpoint)
    model = ShardedCausalLM(spec, ParallelPlan(tp=request.tp, ep=request.ep), rank, request.dtype,
                            max_seq_len=request.max_model_len, max_batch=request.max_batch,
                            max_step_tokens=request.spec_tokens + 1)
    load_shard(model, Path(request.checkpoint))
    return model


def _start_http(app, request: ServeRequest):
    import uvicorn

    config = uvicorn.Config(app, host=request.host, port=request.port, log_level="warning",
                            timeout_graceful_shutdown=5, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="shardwise-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ShardwiseError(f"the HTTP server could not listen on {request.host}:{request.port} "
                                 "(is the port in use?): pick another --port")
        time.sleep(0.05)
    return server, thread


def serve_rank(rank: int, world_size: int, request: ServeRequest) -> dict[str, Any]:
    """Run one rank of the server until shutdown; returns this rank's step count."""
    from shardwise.serve.steps import StepRunner, follow

    torch.set_grad_enabled(False)
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return {"rank": rank, "steps": follow(StepRunner(load_model(rank, request)), world_size)}
    from shardwise.runtime import peer_watch
    from shardwise.runtime.drafters import PromptLookup
    from shardwise.serve.app import build_app
    from shardwise.serve.engine import Engine
    from shardwise.serve.metrics import ServerMetrics
    from shardwise.serve.protocol import Limits
    from shardwise.serve.scheduler import Scheduler
    from shardwise.serve.text import ServeTokenizer

    tokenizer = ServeTokenizer(request.checkpoint)
    metrics = ServerMetrics(request.max_batch)
    drafter = partial(PromptLookup, request.ngram_min, request.ngram_max)
    scheduler = Scheduler(request.max_batch, request.prefill_chunk, tokenizer.eos, metrics, request.spec_tokens,
                          drafter, request.max_model_len)
    engine = Engine(scheduler, world_size, metrics)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: engine.request_stop())
    peer_watch.on_peer_failure(engine.fail)
    limits = Limits(_vocab(request), request.max_model_len, request.model_name)
    server, thread = _start_http(build_app(engine, tokenizer, limits, metrics), request)
    try:
        engine.ready(StepRunner(load_model(0, request)))
        print(f"[shardwise serve] ready: http://{request.host}:{request.port}/v1 (model '{request.model_name}', "
              f"TP{request.tp} EP{request.ep}, {request.max_batch} slots x {request.max_model_len} tokens"
              + (f", prompt-lookup speculation k={request.spec_tokens} for a sequence alone" if request.spec_tokens else "")
              + ")",
              flush=True)
        steps = engine.loop()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return {"rank": 0, "steps": steps}


def _vocab(request: ServeRequest) -> int:
    from shardwise.runtime.loader import load_spec

    return load_spec(request.checkpoint).vocab_size
