"""`shardwise run [CHECKPOINT]` and `shardwise make-checkpoint`: run a model split over local
processes (or over torchrun-started ranks), and write tiny random checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from shardwise.errors import ShardwiseError
from shardwise.runtime import DEFAULT_TIMEOUT_S

INT_ACTIVATIONS_HELP = ("rows int8 / int4 / MXFP4 weights multiply: float (as they are, the default) or int8 (each "
                        "32-block rounded to int8 and multiplied with AVX-512 VNNI: llama.cpp's Q8_0 / Q4_0 / MXFP4 x Q8_0)")



def runtime_layout(checkpoint: Path | None, tp: int | None, ep: int | None):
    """(under torchrun?, checkpoint folder, its ModelSpec, tp, ep) for `run` and `serve`: the bundled
    default without a checkpoint; tp defaults to the torchrun world size (2 locally) and must equal it;
    ep to ``plan.default_ep``; the layout checked runnable."""
    from shardwise.plan import ParallelPlan, default_ep
    from shardwise.runtime.checkpoint import default_checkpoint
    from shardwise.runtime.loader import load_spec
    from shardwise.runtime.model import check_runnable

    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else None
    folder = checkpoint if checkpoint is not None else default_checkpoint()
    spec = load_spec(folder)
    tp = tp if tp is not None else (world or 2)
    if world is not None and tp != world:
        raise ShardwiseError(f"--tp {tp} must equal the torchrun world size {world} (the runtime has no --pp yet)")
    ep = ep if ep is not None else default_ep(spec, tp)
    check_runnable(spec, ParallelPlan(tp=tp, ep=ep))
    return torchrun, folder, spec, tp, ep


def resolve_allreduce(allreduce: str, spec, dtype: str, tp: int, torchrun: bool, backend: str,
                      cluster: str | None = None) -> tuple[str, str | None]:
    """(the all-reduce algorithm `run` / `serve` use, the line saying why when ``auto`` chose it:
    ``perf.allreduce_choice.choose_for_run``); a name checked. The caller prints the line once
    every other check passed, so a bad flag stays a one-line error."""
    from shardwise.runtime.comm import get_allreduce
    from shardwise.runtime.model import torch_dtype

    if allreduce == "auto":
        from shardwise.perf.allreduce_choice import choose_for_run

        local = int(os.environ.get("LOCAL_WORLD_SIZE", tp)) if torchrun else tp
        choice = choose_for_run(spec.hidden_size, torch_dtype(dtype).itemsize, tp, cluster, local, backend=backend)
        return choice.name, choice.describe()
    get_allreduce(allreduce)
    return allreduce, None


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
        "speculative": first["speculative"],
        "int_activations": first["int_activations"],
        "ranks": [
            {k: r[k] for k in ("rank", "threads", "param_bytes", "cache_bytes", "experts", "load_s", "prefill_s",
                               "tok_per_s")}
            for r in reports
        ],
    }


def _trace_paths(path: Path) -> tuple[Path, Path]:
    """(Chrome trace path, sibling summary path ``NAME.summary.json``); the folder must exist."""
    if not path.parent.is_dir():
        raise ShardwiseError(f"--trace {path}: folder '{path.parent}' does not exist")
    return path, path.with_suffix(".summary.json")


def _check_trace(path: Path) -> None:
    """Refuse a --trace path that cannot be written, before any rank starts: both files are opened
    for appending (one this creates is removed again, so a run that fails later leaves nothing)."""
    for target in _trace_paths(path):
        existed = target.exists()
        try:
            with target.open("a"):
                pass
        except OSError as exc:
            raise ShardwiseError(f"--trace {path}: cannot write '{target}' ({exc.strerror}): pass a writable file path") from None
        if not existed:
            target.unlink()


def _write_trace(spec, request, reports: list[dict[str, Any]], path: Path, tok_per_s: float) -> dict[str, Any]:
    """Write the Chrome trace and its summary; return ``{"path", "summary_path", "summary"}``."""
    from shardwise.runtime.trace import chrome_trace, summarize

    ranks = [r["trace"] for r in reports]
    summary = summarize(ranks, spec.name, request.tp, request.ep, tok_per_s)
    trace_path, summary_path = _trace_paths(path)
    meta = {"model": spec.name, "tp": request.tp, "ep": request.ep, "measured_tok_per_s": tok_per_s}
    trace_path.write_text(json.dumps(chrome_trace(ranks, meta)))
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    return {"path": str(trace_path), "summary_path": str(summary_path), "summary": summary}


def _print_trace(trace: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from shardwise.runtime.trace import kind_breakdown

    summary, con = trace["summary"], Console()

    def pct(x: float, total: float) -> str:
        return f"{100 * x / total:.0f}%" if total > 0 else "-"

    t = Table(title=f"decode step time by rank (mean of {summary['decode_steps']} steps)")
    for col in ("rank", "step ms", "compute", "comm", "wait", "trace sync", "other", "last to arrive"):
        t.add_column(col, justify="right")
    for r in summary["ranks"]:
        step = r["step_s"]
        t.add_row(str(r["rank"]), f"{step * 1e3:.2f}", pct(r["compute_s"], step), pct(r["comm_s"], step),
                  pct(r["wait_s"], step), pct(r["sync_s"], step), pct(r["other_s"], step),
                  f"{100 * r['last_arrival_share']:.0f}%")
    con.print(t)
    steps = {r["rank"]: r["step_s"] for r in summary["ranks"]}
    k = Table(title="by layer type (ms per step, share of the step)")
    for col in ("rank", "layer type", "layers", "compute", "comm", "wait"):
        k.add_column(col, justify="right")
    for row in kind_breakdown(summary):
        step = steps[row["rank"]]
        k.add_row(str(row["rank"]), row["kind"], str(row["layers"]),
                  *(f"{row[c] * 1e3:.2f} ({pct(row[c], step)})" for c in ("compute_s", "comm_s", "wait_s")))
    con.print(k)
    slow = next(r for r in summary["ranks"] if r["rank"] == summary["slowest_rank"])
    others = [r for r in summary["ranks"] if r["rank"] != slow["rank"]]
    versus = f" vs {max(r['compute_s'] for r in others) * 1e3:.2f} ms at most elsewhere" if others else ""
    con.print(
        f"slowest rank: [bold]{slow['rank']}[/] (last to arrive at {100 * slow['last_arrival_share']:.0f}% of its "
        f"all-reduces; compute {slow['compute_s'] * 1e3:.2f} ms/step{versus}); trace sync is the arrival-time "
        f"exchange tracing adds. Trace: {trace['path']} (Perfetto), summary: {trace['summary_path']}",
        highlight=False,
    )


def _print_speculative(spec: dict[str, Any]) -> None:
    from rich.console import Console

    def ms(x: float | None) -> str:
        return f"{x * 1e3:.2f} ms" if x is not None else "-"

    def rate(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "-"

    by_position = " ".join(rate(a) for a in spec["acceptance_by_position"])
    speedup = f"{spec['speedup']:.2f}×" if spec["speedup"] is not None else "-"
    Console().print(
        f"speculative ({spec['method']}, k={spec['spec_tokens']}): drafted {spec['drafted']}, accepted "
        f"{spec['accepted']} (rate {rate(spec['acceptance_rate'])}; by position {by_position}); "
        f"{rate(spec['tokens_per_step'])} tokens per verify step; verify step {ms(spec['verify_step_s'])} vs plain "
        f"step {ms(spec['plain_step_s'])}; speed-up [bold]{speedup}[/] over plain decode "
        f"({spec['plain_tok_per_s']:.1f} tok/s)",
        highlight=False,
    )


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
        allreduce: Annotated[str, typer.Option("--allreduce", help="builtin, ring, rd, oneshot, two-level, shm (shared memory, ranks on one host) or auto (shm for gloo ranks on one host, else cheapest by the α-β model)")] = "auto",
        cluster: Annotated[Optional[str], typer.Option("--cluster", help="cluster TOML (from `shardwise probe`) whose α/β --allreduce auto uses")] = None,
        trace: Annotated[Optional[Path], typer.Option("--trace", help="write a per-layer, per-rank Chrome trace (Perfetto) here and its summary to NAME.summary.json")] = None,
        timeout: Annotated[float, typer.Option("--timeout", help="seconds the rendezvous or one collective may block before the run fails")] = DEFAULT_TIMEOUT_S,
        spec_method: Annotated[Optional[str], typer.Option("--spec", help="speculative decoding: ngram (prompt lookup) or draft (with --draft)")] = None,
        spec_tokens: Annotated[int, typer.Option("--spec-tokens", help="tokens drafted per verify step (k)")] = 4,
        ngram_min: Annotated[int, typer.Option("--ngram-min", help="shortest n-gram prompt lookup matches")] = 1,
        ngram_max: Annotated[int, typer.Option("--ngram-max", help="longest n-gram prompt lookup matches (tried first)")] = 3,
        draft: Annotated[Optional[Path], typer.Option("--draft", help="draft model checkpoint (same vocabulary; implies --spec draft)")] = None,
        int_activations: Annotated[Optional[str], typer.Option("--int-activations", help=INT_ACTIVATIONS_HELP)] = None,
        json_out: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
    ) -> None:
        """Generate with the model split over --tp local processes (or join a torchrun group)."""
        from shardwise.runtime.generate import (
            DEFAULT_PROMPT, SamplingParams, check_prompt, encode_prompt, max_positions, parse_prompt_ids,
        )
        from shardwise.runtime.int_matmul import check_activations
        from shardwise.runtime.loader import Checkpoint, check_checkpoint, load_spec
        from shardwise.runtime.model import torch_dtype
        from shardwise.runtime.rendezvous import check_backend, check_timeout
        from shardwise.runtime.runner import RunRequest, run_rank

        if prompt is not None and prompt_ids is not None:
            raise ShardwiseError("pass either --prompt or --prompt-ids, not both")
        check_backend(backend)
        torchrun, folder, spec, tp, ep = runtime_layout(checkpoint, tp, ep)
        allreduce, chosen = resolve_allreduce(allreduce, spec, dtype, tp, torchrun, backend, cluster)
        torch_dtype(dtype)
        SamplingParams(temperature, top_p, seed)
        spec_params = None
        if spec_method is not None or draft is not None:
            from shardwise.runtime.drafters import check_draft
            from shardwise.runtime.speculative import SpecParams

            spec_params = SpecParams(spec_method or "draft", spec_tokens, ngram_min, ngram_max,
                                     str(draft) if draft is not None else None)
            if draft is not None:
                check_draft(folder, draft)
        check_timeout(timeout)
        if int_activations is not None:
            check_activations(int_activations, "--int-activations")
        if trace is not None:
            _check_trace(trace)
        if prompt_ids is not None:
            ids = parse_prompt_ids(prompt_ids)
        else:
            ids = tuple(encode_prompt(folder, prompt if prompt is not None else DEFAULT_PROMPT))
        models = {folder: spec, **({draft: load_spec(draft)} if draft is not None else {})}
        for path, path_spec in models.items():  # what the ranks would refuse, refused before they start
            check_prompt(ids, max_new_tokens, path_spec.vocab_size, *max_positions(path_spec))
            with Checkpoint(path) as ckpt:
                check_checkpoint(path_spec, ckpt)
        request = RunRequest(
            checkpoint=str(folder), prompt_ids=ids, max_new_tokens=max_new_tokens, tp=tp, ep=ep, dtype=dtype,
            temperature=temperature, top_p=top_p, seed=seed, allreduce=allreduce, backend=backend,
            trace=trace is not None, log=True, spec=spec_params, int_activations=int_activations,
        )
        if chosen:
            typer.echo(chosen, err=True)
        if torchrun:
            import torch.distributed as dist

            from shardwise.runtime.peer_watch import torchrun_group

            with torchrun_group(backend, timeout) as (rank, world_size):
                report = run_rank(rank, world_size, request)
                reports: list[Any] = [None] * world_size if rank == 0 else None
                dist.gather_object(report, reports, dst=0)
            if rank != 0:
                return
        else:
            from shardwise.runtime.launch import launch_local

            reports = launch_local(run_rank, tp, args=(request,), backend=backend, timeout_s=timeout)
        doc = _document(spec, Path(folder), request, reports, backend)
        if trace is not None:
            doc["trace"] = _write_trace(spec, request, reports, trace, doc["tok_per_s"])
        if json_out:
            print(json.dumps(doc, indent=2))
        else:
            _print_human(doc)
            if doc["speculative"] is not None:
                _print_speculative(doc["speculative"])
            if trace is not None:
                _print_trace(doc["trace"])

    @app.command("make-checkpoint")
    def make_checkpoint_command(
        model: Annotated[str, typer.Option("--model", help="catalog model key, e.g. deepseek-v3")],
        out: Annotated[Path, typer.Option("--out", help="output folder")],
        scale: Annotated[str, typer.Option("--scale", help="size: tiny, or small (qwen3_5_moe, kimi_linear)")] = "tiny",
        seed: Annotated[int, typer.Option("--seed", help="random seed of the weights")] = 0,
    ) -> None:
        """Write a small random checkpoint of a catalog model in the Hugging Face layout."""
        from shardwise.runtime.checkpoint import make_checkpoint

        folder = make_checkpoint(model, scale, out, seed)
        print(f"wrote {folder} (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat template)")
