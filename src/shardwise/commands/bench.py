"""`shardwise bench CHECKPOINT --tp N`: predicted vs measured decode, per layer and term.
`shardwise bench --url http://HOST:PORT/v1`: an OpenAI-compatible server instead (``bench_serving``).

Probes this host (or reads ``--probe`` JSON from `shardwise probe --json-out`), runs the
checkpoint with the runtime (plain for tok/s, traced for per-layer times), plans the same
model and layout on the probed cluster with the calibrated ``shardwise`` profile, prints
both side by side and writes one JSON (``--out``) and one Chrome trace (``--trace``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from shardwise.errors import ShardwiseError

BENCH_PROBE_ALGORITHMS = ("ring", "rd", "oneshot")
BENCH_BACKEND = "gloo"
"""Process-group backend of the bench's ranks (``launch_local``'s default)."""
BENCH_REPEATS = 3
"""Measured generations per bench (``--repeats``), interleaved with host probes in the same ranks."""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def render(doc: dict[str, Any]) -> None:
    """Print predicted vs measured tok/s and the per-layer terms with their errors."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"{doc['model']} TP{doc['tp']} EP{doc['ep']}, all-reduce {doc['allreduce']}: "
                    f"per layer, mean of {doc['decode_steps']} decode steps (ms)")
    for col in ("layer", "kind", "rank", "compute", "pred", "err", "comm+wait", "pred", "err"):
        t.add_column(col, justify="right")
    for r in doc["layers"]:
        t.add_row(str(r["layer"]), r["kind"], str(r["rank"]), f"{r['compute_s'] * 1e3:.3f}",
                  f"{r['predicted_compute_s'] * 1e3:.3f}", _pct(r["compute_error"]), f"{r['comm_wait_s'] * 1e3:.3f}",
                  f"{r['predicted_comm_s'] * 1e3:.3f}", _pct(r["comm_error"]))
    con.print(t)
    for term, rows in doc["totals"].items():
        parts = ", ".join(f"rank {r['rank']} {r['measured_s'] * 1e3:.2f} measured / {r['predicted_s'] * 1e3:.2f} "
                          f"predicted ({_pct(r['error'])})" for r in rows)
        con.print(f"{'comm+wait' if term == 'comm' else term} per step: {parts}")
    con.print(f"decode: predicted [bold]{doc['predicted_tok_per_s']:.1f} tok/s[/], measured "
              f"[bold]{doc['measured_tok_per_s']:.1f} tok/s[/] (error {_pct(doc['error'])}; traced run "
              f"{doc['traced_tok_per_s']:.1f} tok/s)")
    pr = doc["prediction"]
    con.print(f"[dim]model: {pr['ops_per_step']:.0f} ops/step x {pr['op_overhead_s'] * 1e6:.1f} us, "
              f"{pr['memory_bandwidth_gbps']:.1f} GB/s, {pr['tflops']:.4f} TFLOPS, alpha "
              f"{pr['link_alpha_s'] * 1e6:.0f} us, beta {pr['link_beta_gbps']:.2f} GB/s, per-call overhead "
              f"{pr['collective_overhead_s'] * 1e6:.0f} us[/]")
    for key in ("json_path", "trace_path"):
        if doc.get(key):
            con.print(f"wrote {doc[key]}")


def register(app: typer.Typer) -> None:
    """Add the `bench` verb."""

    @app.command("bench")
    def bench_command(
        checkpoint: Annotated[Optional[Path], typer.Argument(help="HF safetensors checkpoint folder (default: the cached tiny qwen3_moe)")] = None,
        tp: Annotated[int, typer.Option("--tp", help="tensor-parallel ranks (local processes)")] = 1,
        ep: Annotated[Optional[int], typer.Option("--ep", help="expert-parallel degree (default: experts over all TP ranks)")] = None,
        prompt_ids: Annotated[Optional[str], typer.Option("--prompt-ids", help="prompt token ids, e.g. 1,2,3")] = None,
        max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="tokens to decode")] = 48,
        dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16")] = "float32",
        allreduce: Annotated[str, typer.Option("--allreduce", help="ring, rd, oneshot, two-level, builtin, shm (ranks on one host) or auto")] = "auto",
        probe: Annotated[Optional[Path], typer.Option("--probe", help="probe JSON (`shardwise probe --json-out`); default: probe now")] = None,
        out: Annotated[Optional[Path], typer.Option("--out", help="bench JSON path (default bench.json; with --url: none)")] = None,
        trace: Annotated[Path, typer.Option("--trace", help="Chrome trace path (measured ranks + predicted step)")] = Path("bench.trace.json"),
        timeout: Annotated[float, typer.Option("--timeout", help="seconds a rendezvous or collective may block; with --url, seconds one request may take")] = 120.0,
        json_out: Annotated[bool, typer.Option("--json", help="print the bench JSON")] = False,
        url: Annotated[Optional[str], typer.Option("--url", help="measure an OpenAI-compatible server instead, e.g. http://127.0.0.1:8080/v1")] = None,
        model: Annotated[Optional[str], typer.Option("--model", help="with --url: the served model (default: the first of GET /models)")] = None,
        pp: Annotated[Optional[int], typer.Option("--pp", help="with --url: prompt tokens per request (default 2048)")] = None,
        tg: Annotated[Optional[int], typer.Option("--tg", help="with --url: tokens generated per request (default 128)")] = None,
        depth: Annotated[Optional[str], typer.Option("--depth", help="with --url: context depths before the prompt, e.g. 0,4096,16384 (default 0)")] = None,
        concurrency: Annotated[Optional[str], typer.Option("--concurrency", help="with --url: requests at once, e.g. 1,4 (default 1)")] = None,
        runs: Annotated[Optional[int], typer.Option("--runs", help="with --url: waves per point (default 3)")] = None,
        endpoint: Annotated[Optional[str], typer.Option("--endpoint", help="with --url: completions (default) or chat")] = None,
        api_key: Annotated[Optional[str], typer.Option("--api-key", help="with --url: bearer token the server wants")] = None,
        plan_model: Annotated[Optional[str], typer.Option("--plan-model", help="with --url: catalog model whose plan is printed beside each point")] = None,
        box: Annotated[Optional[str], typer.Option("--box", help="with --plan-model: box from the catalog")] = None,
        boxes: Annotated[Optional[int], typer.Option("--boxes", help="with --plan-model: number of boxes")] = None,
        link: Annotated[Optional[str], typer.Option("--link", help="with --plan-model: link from the catalog (default 100g-roce)")] = None,
        runtime: Annotated[Optional[str], typer.Option("--runtime", help="with --plan-model: runtime profile (default vllm)")] = None,
        repeats: Annotated[int, typer.Option("--repeats", help="measured generations, each between host probes in the ranks")] = BENCH_REPEATS,
    ) -> None:
        """Run a checkpoint traced and plan it on the probed cluster: predicted vs measured decode.
        With --url, measure an OpenAI-compatible server per pp/tg @ depth point and concurrency."""
        if url is not None:
            if checkpoint is not None:
                raise ShardwiseError("pass either a CHECKPOINT or --url, not both")
            from shardwise.commands.bench_serving import serving_bench

            return serving_bench(url, model, pp, tg, depth, concurrency, runs, endpoint, api_key, timeout, plan_model,
                                 box, boxes, link, runtime, out, json_out)
        given = [f for f, v in (("--model", model), ("--pp", pp), ("--tg", tg), ("--depth", depth),
                                ("--concurrency", concurrency), ("--runs", runs), ("--endpoint", endpoint),
                                ("--api-key", api_key), ("--plan-model", plan_model), ("--box", box),
                                ("--boxes", boxes), ("--link", link), ("--runtime", runtime)) if v is not None]
        if given:
            raise ShardwiseError(f"{given[0]} is for measuring a server: pass --url http://HOST:PORT/v1")
        out = out if out is not None else Path("bench.json")
        from shardwise.runtime.rendezvous import MAX_TIMEOUT_S
        from shardwise.measure.bench import (OpCounts, bench_document, count_rank_ops, predict,
                                             predicted_trace_events, with_host_probe)
        from shardwise.measure.probe import ProbeConfig, run_probe
        from shardwise.perf.allreduce_choice import choose_allreduce
        from shardwise.plan import ParallelPlan, default_ep
        from shardwise.runtime.checkpoint import default_checkpoint
        from shardwise.runtime.comm import get_allreduce
        from shardwise.runtime.generate import (DEFAULT_PROMPT, check_prompt, encode_prompt, max_positions,
                                                parse_prompt_ids)
        from shardwise.runtime.launch import launch_local
        from shardwise.runtime.loader import Checkpoint, check_checkpoint, load_spec
        from shardwise.runtime.model import check_runnable, torch_dtype
        from shardwise.runtime.rendezvous import check_backend
        from shardwise.runtime.runner import RunRequest, run_rank
        from shardwise.runtime.trace import chrome_trace, summarize

        if tp < 1:
            raise ShardwiseError(f"--tp must be >= 1, got {tp}")
        if repeats < 1:
            raise ShardwiseError(f"--repeats must be >= 1 (measured generations), got {repeats}")
        if max_new_tokens < 4:
            raise ShardwiseError(f"--max-new-tokens must be >= 4 for a decode measurement, got {max_new_tokens}")
        folder = checkpoint if checkpoint is not None else default_checkpoint()
        spec = load_spec(folder)
        ep = ep if ep is not None else default_ep(spec, tp)
        check_runnable(spec, ParallelPlan(tp=tp, ep=ep))
        torch_dtype(dtype)
        if allreduce != "auto":
            get_allreduce(allreduce)
        for path in (out, trace):
            if not path.parent.is_dir():
                raise ShardwiseError(f"{path}: folder '{path.parent}' does not exist")
        ids = parse_prompt_ids(prompt_ids) if prompt_ids is not None else tuple(encode_prompt(folder, DEFAULT_PROMPT))
        # what the ranks (the probe's included) would refuse, refused before any starts, as `shardwise run` does
        check_backend(BENCH_BACKEND)
        if not 0 < timeout <= MAX_TIMEOUT_S:
            raise ShardwiseError(f"--timeout must be > 0 and at most {MAX_TIMEOUT_S} seconds (a week), got {timeout:g}")
        check_prompt(ids, max_new_tokens, spec.vocab_size, *max_positions(spec))
        with Checkpoint(folder) as ckpt:
            check_checkpoint(spec, ckpt)
        if probe is not None:
            try:
                probe_doc = json.loads(probe.read_text())
            except (OSError, ValueError) as exc:
                raise ShardwiseError(f"--probe {probe}: cannot read a probe JSON ({exc})") from None
            if probe_doc.get("kind") != "probe":
                raise ShardwiseError(f"--probe {probe}: not a `shardwise probe --json-out` document")
            if tp > 1 and probe_doc.get("ring_fit") is None:
                raise ShardwiseError(f"--probe {probe} has no link figures (probed with 1 rank): probe with --ranks {tp}")
        else:
            algs = BENCH_PROBE_ALGORITHMS + ((allreduce,) if allreduce not in BENCH_PROBE_ALGORITHMS + ("auto",) else ())
            cfg = ProbeConfig(max_bytes=1 << 20, iters=10, algorithms=algs, matmul_size=256,
                              dtypes=(("fp32", "bf16") if torch_dtype(dtype).itemsize == 4 else ("bf16", "fp32")))
            probe_doc = run_probe(cfg, tp, timeout_s=timeout, show_progress=not json_out)
            from shardwise.measure.probe import DEFAULT_BOX, DEFAULT_LINK
            from shardwise.measure.probe_fit import cluster_of
            from shardwise.spec.hardware import cluster_to_toml

            probe_doc["cluster"] = cluster_to_toml(cluster_of(probe_doc, DEFAULT_BOX, DEFAULT_LINK, "shardwise bench probe"))
        if allreduce == "auto":
            if tp > 1:
                fit = probe_doc["ring_fit"]
                choice = choose_allreduce(spec.hidden_size * torch_dtype(dtype).itemsize, tp, fit["alpha_s"],
                                          fit["beta_gbps"] * 1e9, "probe ring fit")
                allreduce = choice.name
                if not json_out:
                    typer.echo(choice.describe(), err=True)
            else:
                allreduce = "builtin"
        counted = launch_local(count_rank_ops, 1, args=(str(folder), tp, ep, dtype, ids), timeout_s=timeout)[0]
        ops = OpCounts(layers=tuple(counted["layers"]), other=counted["other"])
        common = dict(checkpoint=str(folder), prompt_ids=ids, max_new_tokens=max_new_tokens, tp=tp, ep=ep,
                      dtype=dtype, allreduce=allreduce, threads=1)  # one thread a rank, as the probe measures
        plain = launch_local(run_rank, tp, args=(RunRequest(**common, host_probe=repeats),), timeout_s=timeout)
        probe_doc = with_host_probe(probe_doc, plain, allreduce)
        traced = launch_local(run_rank, tp, args=(RunRequest(**common, trace=True),), timeout_s=timeout)
        measured = 1.0 / max(statistics.median(r["decode_step_s"]) for r in plain)
        if any(r["tokens"] != traced[0]["tokens"] for r in plain + traced):
            raise ShardwiseError("ranks or runs generated different tokens: the reduction is not deterministic")
        ranks = [r["trace"] for r in traced]
        summary = summarize(ranks, spec.name, tp, ep, min(r["tok_per_s"] for r in traced))
        context = len(ids) + max_new_tokens // 2
        prediction = predict(spec, tp, ep, dtype, context, probe_doc, allreduce, ops)
        doc = bench_document(spec.name, tp, ep, allreduce, measured, summary, prediction)
        chrome = chrome_trace(ranks, {"model": spec.name, "tp": tp, "ep": ep, "measured_tok_per_s": measured,
                                      "predicted_tok_per_s": doc["predicted_tok_per_s"]})
        first_decode = min((e["ts"] for e in chrome["traceEvents"] if e.get("cat") == "step"
                            and e["args"].get("kind") == "decode"), default=0.0)
        chrome["traceEvents"] += predicted_trace_events(prediction, first_decode, pid=tp)
        try:
            out.write_text(json.dumps(doc, indent=2))
            trace.write_text(json.dumps(chrome))
        except OSError as exc:
            raise ShardwiseError(f"cannot write bench output ({exc.strerror}): {exc.filename}") from None
        doc["json_path"], doc["trace_path"] = str(out), str(trace)
        if json_out:
            print(json.dumps(doc, indent=2))
        else:
            render(doc)
