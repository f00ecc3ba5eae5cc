"""`shardwise serve [CHECKPOINT] --tp N`: the sharded model behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer

from shardwise.commands.run import INT_ACTIVATIONS_HELP
from shardwise.errors import ShardwiseError

SERVE_TIMEOUT_S = 30.0
"""Default seconds one collective may block before the server fails (a frozen rank is noticed
within this; rank 0 sends a heartbeat every second while idle so an idle server never waits that long)."""

DEFAULT_MODEL_LEN = 2048
"""Tokens per slot (--max-model-len) when not given and the model has at least that many positions."""

MAX_SLOTS = 256
"""Most KV-cache slots (--max-batch) one server holds."""


def _check_port(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise ShardwiseError(f"--port must be in 1..65535, got {port}")
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as exc:
        raise ShardwiseError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pick another --port or --host") from None


def register(app: typer.Typer) -> None:
    """Add the `serve` verb."""

    @app.command("serve")
    def serve_command(
        checkpoint: Annotated[Optional[Path], typer.Argument(help="HF safetensors checkpoint folder (default: the cached tiny qwen3_moe)")] = None,
        tp: Annotated[Optional[int], typer.Option("--tp", help="tensor-parallel ranks (default 2; the world size under torchrun)")] = None,
        ep: Annotated[Optional[int], typer.Option("--ep", help="expert-parallel degree (default: experts over all TP ranks)")] = None,
        host: Annotated[str, typer.Option("--host", help="address to listen on (loopback unless you say otherwise)")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", help="TCP port of the HTTP API")] = 8000,
        max_batch: Annotated[int, typer.Option("--max-batch", help="sequences decoded together (KV-cache / state slots)")] = 8,
        max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", help="tokens per sequence (prompt + generated), the size of each slot (default: 2048 or the model's positions if fewer)")] = None,
        prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="prompt tokens read per step between decode steps")] = 128,
        dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16")] = "float32",
        allreduce: Annotated[str, typer.Option("--allreduce", help="builtin, ring, rd, oneshot, two-level, shm (shared memory, ranks on one host) or auto (shm for gloo ranks on one host, else cheapest by the α-β model)")] = "auto",
        backend: Annotated[str, typer.Option("--backend", help="gloo (CPU) or nccl (GPU)")] = "gloo",
        cluster: Annotated[Optional[str], typer.Option("--cluster", help="cluster TOML (from `shardwise probe`) whose α/β --allreduce auto uses")] = None,
        served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="model id clients send (default: the checkpoint folder's name)")] = None,
        timeout: Annotated[float, typer.Option("--timeout", help="seconds one collective may block before the server fails")] = SERVE_TIMEOUT_S,
        spec_method: Annotated[Optional[str], typer.Option("--spec", help="speculative decoding for a greedy request decoding alone: ngram (prompt lookup)")] = None,
        spec_tokens: Annotated[int, typer.Option("--spec-tokens", help="tokens drafted per verify pass (k)")] = 4,
        ngram_min: Annotated[int, typer.Option("--ngram-min", help="shortest n-gram prompt lookup matches")] = 1,
        ngram_max: Annotated[int, typer.Option("--ngram-max", help="longest n-gram prompt lookup matches (tried first)")] = 3,
        int_activations: Annotated[Optional[str], typer.Option("--int-activations", help=INT_ACTIVATIONS_HELP)] = None,
    ) -> None:
        """Serve the model split over --tp local processes (or a torchrun group) on an OpenAI-compatible API."""
        from shardwise.commands.run import resolve_allreduce, runtime_layout
        from shardwise.runtime.loader import Checkpoint, check_checkpoint
        from shardwise.runtime.model import torch_dtype
        from shardwise.runtime.rendezvous import check_backend, check_timeout
        from shardwise.serve.rank import ServeRequest, serve_rank
        from shardwise.serve.text import ServeTokenizer

        torchrun, folder, spec, tp, ep = runtime_layout(checkpoint, tp, ep)
        if not 1 <= max_batch <= MAX_SLOTS:
            raise ShardwiseError(f"--max-batch must be in 1..{MAX_SLOTS}, got {max_batch}")
        if max_model_len is None:
            max_model_len = min(DEFAULT_MODEL_LEN, spec.max_position_embeddings)
        if not 2 <= max_model_len <= spec.max_position_embeddings:
            raise ShardwiseError(f"--max-model-len must be in 2..{spec.max_position_embeddings} (the model's "
                                 f"max_position_embeddings), got {max_model_len}")
        if prefill_chunk < 1:
            raise ShardwiseError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
        check_timeout(timeout)
        if spec_method is not None:
            from shardwise.runtime.speculative import SpecParams

            if spec_method == "draft":
                raise ShardwiseError("serve drafts by prompt lookup only (--spec ngram): a draft model would need "
                                     "a cache per slot of its own; `shardwise run --spec draft` runs one")
            SpecParams(spec_method, spec_tokens, ngram_min, ngram_max)
        torch_dtype(dtype)
        if int_activations is not None:
            from shardwise.runtime.int_matmul import check_activations

            check_activations(int_activations, "--int-activations")
        check_backend(backend)
        allreduce, chosen = resolve_allreduce(allreduce, spec, dtype, tp, torchrun, backend, cluster)
        with Checkpoint(folder) as ckpt:
            check_checkpoint(spec, ckpt)
        ServeTokenizer(folder)  # a missing or broken tokenizer fails here, before any rank starts
        request = ServeRequest(
            checkpoint=str(folder), model_name=served_model_name or Path(folder).resolve().name, tp=tp, ep=ep,
            dtype=dtype, host=host, port=port, max_batch=max_batch, max_model_len=max_model_len,
            prefill_chunk=prefill_chunk, allreduce=allreduce, backend=backend,
            spec_tokens=spec_tokens if spec_method is not None else 0, ngram_min=ngram_min, ngram_max=ngram_max,
            int_activations=int_activations,
        )
        if torchrun:
            from shardwise.runtime.peer_watch import torchrun_group

            if chosen:
                typer.echo(chosen, err=True)
            with torchrun_group(backend, timeout) as (rank, world_size):
                if rank == 0:
                    _check_port(host, port)
                else:  # torchrun signals every worker; rank 0 drains the group and tells the others to stop
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                serve_rank(rank, world_size, request)
            return
        from shardwise.runtime.launch import launch_local

        _check_port(host, port)
        if chosen:
            typer.echo(chosen, err=True)
        launch_local(serve_rank, tp, args=(request,), backend=backend, timeout_s=timeout, forward_signals=True)
        typer.echo("[shardwise serve] stopped", err=True)
