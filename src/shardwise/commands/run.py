"""`shardwise run [CHECKPOINT]` and `shardwise make-checkpoint`: run a model split over local
processes (or over torchrun-started ranks), and write tiny random checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from shardwise.errors import ShardwiseError

DEFAULT_PROMPT = "Hello world"


def _parse_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ShardwiseError(f"--prompt-ids '{text}' must be comma-separated integers like 1,2,3") from None
    if not ids:
        raise ShardwiseError("--prompt-ids is empty: pass comma-separated integers like 1,2,3")
    return ids


def _default_ep(spec, tp: int) -> int:
    """Experts spread over all TP ranks when they divide evenly, else the largest divisor that does."""
    if spec.moe is None:
        return 1
    return max(d for d in range(1, tp + 1) if tp % d == 0 and spec.moe.num_experts % d == 0)


def _document(spec, folder: Path, request, reports: list[dict[str, Any]], backend: str) -> dict[str, Any]:
    from shardwise.runtime.generate import load_tokenizer

    first = reports[0]
    if any(r["tokens"] != first["tokens"] for r in reports):
        raise ShardwiseError("ranks generated different tokens: the reduction is not deterministic")
    tok = load_tokenizer(folder)
    return {
        "model": spec.name,
        "model_type": spec.model_type,
        "checkpoint": str(folder),
        "plan": {"tp": request.tp, "ep": request.ep, "pp": 1},
        "backend": backend,
        "allreduce": request.allreduce,
        "dtype": request.dtype,
        "prompt_ids": list(request.prompt_ids),
        "tokens": first["tokens"],
        "text": tok.decode(first["tokens"]) if tok is not None else None,
        "stopped_by": first["stopped_by"],
        "prefill_s": first["prefill_s"],
        "decode_s": first["decode_s"],
        "tok_per_s": first["tok_per_s"],
        "ranks": [
            {k: r[k] for k in ("rank", "param_bytes", "cache_bytes", "experts", "load_s", "prefill_s", "tok_per_s")}
            for r in reports
        ],
    }


def _print_human(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if doc["text"] is not None:
        con.print(f"[bold]{doc['text']}[/]", markup=True, highlight=False)
    con.print(f"tokens: {doc['tokens']}")
    con.print(
        f"{len(doc['tokens'])} tokens ({doc['stopped_by']}), prefill {doc['prefill_s'] * 1e3:.1f} ms, "
        f"decode [bold]{doc['tok_per_s']:.1f} tok/s[/] — TP{doc['plan']['tp']} EP{doc['plan']['ep']}, "
        f"{doc['backend']}, all-reduce {doc['allreduce']}, {doc['dtype']}"
    )
    t = Table(title=f"{doc['model']} per rank")
    for col in ("rank", "param bytes", "cache bytes", "experts", "load s", "tok/s"):
        t.add_column(col, justify="right")
    for r in doc["ranks"]:
        experts = f"{r['experts'][0]}–{r['experts'][-1]}" if r["experts"] else "-"
        t.add_row(str(r["rank"]), f"{r['param_bytes']:,}", f"{r['cache_bytes']:,}", experts,
                  f"{r['load_s']:.2f}", f"{r['tok_per_s']:.1f}")
    con.print(t)


def register(app: typer.Typer) -> None:
    """Add the `run` and `make-checkpoint` verbs."""

    @app.command("run")
    def run_command(
        checkpoint: Annotated[Optional[Path], typer.Argument(help="HF safetensors checkpoint folder (default: a cached tiny qwen3_moe)")] = None,
        tp: Annotated[Optional[int], typer.Option("--tp", help="tensor-parallel ranks (default 2; the world size under torchrun)")] = None,
        ep: Annotated[Optional[int], typer.Option("--ep", help="expert-parallel degree (default: experts over all TP ranks)")] = None,
        prompt: Annotated[Optional[str], typer.Option("--prompt", help="prompt text (needs tokenizer.json)")] = None,
        prompt_ids: Annotated[Optional[str], typer.Option("--prompt-ids", help="prompt token ids, e.g. 1,2,3")] = None,
        max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="tokens to generate at most")] = 32,
        dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16")] = "float32",
        temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy")] = 0.0,
        top_p: Annotated[float, typer.Option("--top-p", help="nucleus sampling mass")] = 1.0,
        seed: Annotated[int, typer.Option("--seed", help="sampling seed (the same on every rank)")] = 0,
        backend: Annotated[str, typer.Option("--backend", help="gloo (CPU) or nccl (GPU)")] = "gloo",
        allreduce: Annotated[str, typer.Option("--allreduce", help="builtin, ring, rd, oneshot or two-level")] = "builtin",
        json_out: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
    ) -> None:
        """Generate with the model split over --tp local processes (or join a torchrun group)."""
        from shardwise.plan import ParallelPlan
        from shardwise.runtime.checkpoint import default_checkpoint
        from shardwise.runtime.comm import get_allreduce
        from shardwise.runtime.generate import SamplingParams, encode_prompt
        from shardwise.runtime.loader import Checkpoint, check_checkpoint, load_spec
        from shardwise.runtime.model import check_runnable, torch_dtype
        from shardwise.runtime.runner import RunRequest, run_rank

        torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        world = int(os.environ["WORLD_SIZE"]) if torchrun else None
        if prompt is not None and prompt_ids is not None:
            raise ShardwiseError("pass either --prompt or --prompt-ids, not both")
        folder = checkpoint if checkpoint is not None else default_checkpoint()
        spec = load_spec(folder)
        tp = tp if tp is not None else (world or 2)
        if world is not None and tp != world:
            raise ShardwiseError(f"--tp {tp} must equal the torchrun world size {world} (the runtime has no --pp yet)")
        ep = ep if ep is not None else _default_ep(spec, tp)
        plan = ParallelPlan(tp=tp, ep=ep)
        check_runnable(spec, plan)
        get_allreduce(allreduce)
        torch_dtype(dtype)
        SamplingParams(temperature, top_p, seed)
        with Checkpoint(folder) as ckpt:
            check_checkpoint(spec, ckpt)
        if prompt_ids is not None:
            ids = _parse_ids(prompt_ids)
        else:
            ids = tuple(encode_prompt(folder, prompt if prompt is not None else DEFAULT_PROMPT))
        request = RunRequest(
            checkpoint=str(folder), prompt_ids=ids, max_new_tokens=max_new_tokens, tp=tp, ep=ep, dtype=dtype,
            temperature=temperature, top_p=top_p, seed=seed, allreduce=allreduce, backend=backend,
        )
        if torchrun:
            import torch.distributed as dist

            from shardwise.runtime.launch import init_from_env

            rank, world_size = init_from_env(backend)
            report = run_rank(rank, world_size, request)
            reports: list[Any] = [None] * world_size if rank == 0 else None
            dist.gather_object(report, reports, dst=0)
            dist.destroy_process_group()
            if rank != 0:
                return
        else:
            from shardwise.runtime.launch import launch_local

            reports = launch_local(run_rank, tp, args=(request,), backend=backend)
        doc = _document(spec, Path(folder), request, reports, backend)
        if json_out:
            print(json.dumps(doc, indent=2))
        else:
            _print_human(doc)

    @app.command("make-checkpoint")
    def make_checkpoint_command(
        model: Annotated[str, typer.Option("--model", help="catalog model key, e.g. deepseek-v3")],
        out: Annotated[Path, typer.Option("--out", help="output folder")],
        scale: Annotated[str, typer.Option("--scale", help="size: tiny")] = "tiny",
        seed: Annotated[int, typer.Option("--seed", help="random seed of the weights")] = 0,
    ) -> None:
        """Write a small random checkpoint of a catalog model in the Hugging Face layout."""
        from shardwise.runtime.checkpoint import make_checkpoint

        folder = make_checkpoint(model, scale, out, seed)
        print(f"wrote {folder} (config.json, model.safetensors, tokenizer.json)")
