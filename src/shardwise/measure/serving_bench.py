"""`shardwise bench --url`: any OpenAI-compatible server measured the way llama-bench and
llama-benchy name their points, ``pp{P} / tg{T} @ d{D}``, at each concurrency.

Each request is streamed (``/v1/completions``, or ``/v1/chat/completions`` with ``endpoint="chat"``)
with a prompt of exactly ``D + P`` tokens as the server counts them (``serving_prompts``), unique
from its second word on so that no prefix cache serves it, ``temperature=0``, ``max_tokens=T``
and ``ignore_eos`` where the server takes it. Per request:

- TTFT: send to the first streamed chunk that carries a token (its text, even held-back empty text);
- prefill tok/s: prompt tokens / (TTFT - latency), latency = the median TTFT of a one-word prompt
  with ``max_tokens=1`` (llama-benchy's "generation" latency mode: HTTP and one decode step), at
  most half the TTFT taken off (a tiny prompt on a fast server is within the latency's noise);
- decode tok/s: (completion tokens - 1) / (last token - first token), llama-benchy's tg;
- inter-token latency: the gaps between streamed chunks after the first.

A concurrency of C sends C requests at once (threads released by one barrier), ``runs`` times;
the point reports per-request medians, p50/p99 over all requests, and the wave totals
(tokens of all requests over the wave's span). Every HTTP call has a timeout: a server that is
unreachable, is not OpenAI-compatible or stops answering is one ``ShardwiseError`` line.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shardwise.errors import ShardwiseError
from shardwise.measure.serving_client import (CONNECT_TIMEOUT_S, PROBE_TEXT, Server, ServerError, ServingConfig,
                                              Timing)
from shardwise.measure.serving_prompts import CountMethod, Prompt, fit_prompt

ENDPOINTS = ("completions", "chat")


def parse_counts(text: str, flag: str, minimum: int, example: str) -> tuple[int, ...]:
    """``0,4096,16384`` -> (0, 4096, 16384): integers >= ``minimum``, one-line errors."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < minimum for v in values):
        raise ShardwiseError(f"{flag} '{text}' must be comma-separated integers >= {minimum}, e.g. {flag} {example}")
    return tuple(dict.fromkeys(values))


# ---------------------------------------------------------------------------------------- probing


def _tokenizer(server: Server):
    """(endpoint, count function) of the server's tokenize endpoint, or (None, None): llama.cpp's and
    vLLM's ``/tokenize`` (BOS included), llama-cpp-python's ``/extras/tokenize``."""
    candidates = (
        ("/tokenize", lambda t: {"content": t, "prompt": t, "model": server.model, "add_special": True}),
        ("/extras/tokenize", lambda t: {"input": t, "model": server.model}),
    )
    for path, make in candidates:
        def count(text: str, path=path, make=make, timeout: float | None = None) -> int:
            doc = server.call("POST", server.root + path, f"POST {path}", make(text), timeout=timeout)
            tokens = doc.get("tokens") if isinstance(doc, dict) else None
            if not isinstance(tokens, list):
                raise ShardwiseError(f"{server.url}: POST {path} answered no 'tokens' list")
            return len(tokens)

        try:
            if count(PROBE_TEXT, timeout=min(server.cfg.timeout_s, CONNECT_TIMEOUT_S)) > 0:
                return path, count
        except ShardwiseError:
            continue
    return None, None


@dataclass(frozen=True)
class ServerInfo:
    """What the bench learned of the server before measuring: the model it serves (and all it
    lists), how prompt tokens are counted, whether it streams usage and honours ignore_eos, and
    its request latency with an empty prompt (seconds)."""

    model: str
    models: tuple[str, ...]
    method: CountMethod
    stream_usage: bool
    ignore_eos: bool
    latency_s: float


def probe(server: Server) -> tuple[ServerInfo, object]:
    """Model, accepted extras, how prompt tokens are counted and the latency; (info, count function)."""
    ids = server.models()
    if server.cfg.model and ids and server.cfg.model not in ids:
        raise ShardwiseError(f"{server.url} does not serve model '{server.cfg.model}': it serves {', '.join(ids)}")
    if not server.cfg.model and not ids:
        raise ShardwiseError(f"{server.url}: GET /models lists no model: pass --model")
    server.model = server.cfg.model or ids[0]
    wanted = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    timing, last = None, None
    for drop in ((), ("stream_options",), ("ignore_eos",), ("ignore_eos", "stream_options")):
        server.extras = {k: v for k, v in wanted.items() if k not in drop}
        try:
            timing = server.stream(PROBE_TEXT, 4)
            break
        except ServerError as exc:
            if exc.status not in (400, 422):
                raise
            last = exc
    if timing is None:
        raise last
    if not timing.token_times:
        raise ShardwiseError(f"{server.url}: POST {server.path} (stream) streamed no token for a 4-token request")
    endpoint, tokenize = _tokenizer(server)
    if endpoint is not None:
        billed = timing.prompt_tokens if timing.prompt_tokens is not None else server.usage_tokens(PROBE_TEXT, False)
        offset = billed - tokenize(PROBE_TEXT) if billed is not None else 0
        method = CountMethod("tokenize", endpoint, offset)

        def count(text: str) -> int:
            return tokenize(text) + offset
    else:
        method, count = CountMethod("usage", None, 0), server.usage_tokens
        count(PROBE_TEXT)
    first = []
    for _ in range(3):
        t = server.stream("Hi", 1)
        first.append((t.token_times[0] if t.token_times else t.first_response or time.perf_counter()) - t.sent)
    info = ServerInfo(server.model, tuple(ids), method, timing.prompt_tokens is not None,
                      "ignore_eos" in server.extras, statistics.median(first))
    return info, count


def serving_inputs(
    url: str, model: str | None, pp: int | None, tg: int | None, depth: str | None, concurrency: str | None,
    runs: int | None, endpoint: str | None, api_key: str | None, timeout: float, plan_model: str | None,
    box: str | None, boxes: int | None, link: str | None, runtime: str | None,
) -> tuple[ServingConfig, PlanArgs | None]:
    """The CLI's values checked (one-line errors that name the flag), defaults filled in."""
    from shardwise.measure.serving_client import check_url
    from shardwise.perf.scenario import SEED

    pp, tg, runs = (2048 if pp is None else pp), (128 if tg is None else tg), (3 if runs is None else runs)
    if pp < 1:
        raise ShardwiseError(f"--pp must be >= 1 token, got {pp}")
    if tg < 2:
        raise ShardwiseError(f"--tg must be >= 2 tokens (decode speed needs two), got {tg}")
    if runs < 1:
        raise ShardwiseError(f"--runs must be >= 1, got {runs}")
    if timeout <= 0:
        raise ShardwiseError(f"--timeout must be > 0 seconds, got {timeout:g}")
    endpoint = endpoint or "completions"
    if endpoint not in ENDPOINTS:
        raise ShardwiseError(f"--endpoint '{endpoint}' is unknown: use {' or '.join(ENDPOINTS)}")
    cfg = ServingConfig(
        url=check_url(url), model=model, pp=pp, tg=tg, depths=parse_counts(depth or "0", "--depth", 0, "0,4096,16384"),
        concurrency=parse_counts(concurrency or "1", "--concurrency", 1, "1,4"), runs=runs, endpoint=endpoint,
        timeout_s=timeout, api_key=api_key,
    )
    if plan_model is None:
        if any(v is not None for v in (box, boxes, link, runtime)):
            raise ShardwiseError("--box, --boxes, --link and --runtime describe the plan: pass --plan-model too")
        return cfg, None
    if box is None or boxes is None:
        raise ShardwiseError("--plan-model needs --box and --boxes (and optionally --link, --runtime)")
    return cfg, PlanArgs(plan_model, box, boxes, link or SEED["link"], runtime or "vllm")


# ---------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanArgs:
    """The plan's flags: catalog model, box, box count, link and runtime profile."""

    model: str
    box: str
    boxes: int
    link: str
    runtime: str = "vllm"


def plan_predictions(args: PlanArgs, pp: int, tg: int, depths: tuple[int, ...]) -> dict[int, dict]:
    """Per depth: the plan's batch-1 decode tok/s (``perf.estimate`` at context depth + pp + tg/2) and
    prefill tok/s of a depth + pp prompt, with the TTFT and inter-token latency they imply."""
    from shardwise.perf.estimate import estimate
    from shardwise.perf.scenario import build_scenario

    out = {}
    for depth in depths:
        sc = build_scenario(args.model, args.box, args.boxes, args.link, None, None, None, depth + pp + tg // 2,
                            depth + pp, 0, None, None, args.runtime, None, None, None, None, "bf16")
        doc = estimate(sc)
        if not doc["memory"]["fits"]:
            raise ShardwiseError(f"--plan-model {args.model} does not fit on {sc.boxes} x {sc.box.name} at "
                                 f"{depth + pp + tg} tokens of context: it needs {doc['memory']['min_boxes_layout'] or 'more than ' + str(doc['memory']['layout_search_max_boxes'])} boxes")
        decode, prefill = doc["decode"]["tok_per_s"], doc["prefill"]["tok_per_s"]
        out[depth] = {
            "model": sc.model.name, "box": sc.box.name, "boxes": sc.boxes, "link": sc.link.name,
            "layout": doc["plan"]["layout"], "runtime": doc["plan"]["runtime"], "batch": 1,
            "decode_tok_per_s": decode, "prefill_tok_per_s": prefill,
            "ttft_s": (depth + pp) / prefill + 1 / decode, "itl_s": 1 / decode,
            "bottleneck": doc["decode"]["bottleneck"],
        }
    return out


# ---------------------------------------------------------------------------------------- measuring


def run_wave(server: Server, texts: list[str], max_tokens: int) -> list[Timing]:
    """Send ``texts`` at once (one thread each, released together); their timings."""
    barrier = threading.Barrier(len(texts))

    def one(text: str) -> Timing:
        barrier.wait(timeout=server.cfg.timeout_s)
        return server.stream(text, max_tokens)

    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        futures = [pool.submit(one, t) for t in texts]
        return [f.result() for f in futures]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def point_figures(waves: list[list[Timing]], counted: list[list[int]], latency_s: float) -> dict:
    """One point's figures from its waves (``counted``: each request's prompt tokens as counted)."""
    ttft, itl, prefill, decode, prompts, completions = [], [], [], [], [], []
    prefill_total, decode_total = [], []
    for wave, counts in zip(waves, counted):
        firsts, lasts, wave_prompt, wave_decode = [], [], 0, 0
        for t, n_counted in zip(wave, counts):
            if not t.token_times:
                raise ShardwiseError("a request streamed no token: the server stopped before its first token")
            first, last = t.token_times[0] - t.sent, t.token_times[-1] - t.sent
            prompt = t.prompt_tokens if t.prompt_tokens is not None else n_counted
            n = t.completion_tokens if t.completion_tokens is not None else len(t.token_times)
            ttft.append(first)
            prefill.append(prompt / (first - min(latency_s, first / 2)))
            if n > 1 and last > first:
                decode.append((n - 1) / (last - first))
            itl += [b - a for a, b in zip(t.token_times, t.token_times[1:])]
            prompts.append(prompt)
            completions.append(n)
            firsts.append(t.token_times[0])
            lasts.append(t.token_times[-1])
            wave_prompt += prompt
            wave_decode += max(n - 1, 0)
        start = min(t.sent for t in wave)
        span = max(firsts) - start
        prefill_total.append(wave_prompt / (span - min(latency_s, span / 2)))
        if max(lasts) > min(firsts):
            decode_total.append(wave_decode / (max(lasts) - min(firsts)))
    med = statistics.median
    return {
        "requests": len(ttft),
        "prompt_tokens": {"min": min(prompts), "max": max(prompts)},
        "completion_tokens": {"min": min(completions), "max": max(completions)},
        "prefill_tok_per_s": med(prefill), "prefill_total_tok_per_s": med(prefill_total),
        "decode_tok_per_s": med(decode) if decode else None,
        "decode_total_tok_per_s": med(decode_total) if decode_total else None,
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "itl_s": {"p50": _pct(itl, 50), "p99": _pct(itl, 99)},
    }


def point_name(pp: int, tg: int, depth: int) -> str:
    """llama-bench / llama-benchy naming: ``pp2048 / tg128 @ d4096`` (no ``@`` at depth 0)."""
    return f"pp{pp} / tg{tg}" + (f" @ d{depth}" if depth else "")


def measure_server(cfg: ServingConfig, predictions: dict[int, dict] | None = None, progress=None) -> dict:
    """Measure every (depth, concurrency) point of ``cfg``; the bench document (``kind`` serving-bench)."""
    server = Server(cfg, connections=max(cfg.concurrency))
    try:
        info, count = probe(server)
        points, notes, k, words_per_token = [], [], 0, 0.5
        for depth in cfg.depths:
            target = depth + cfg.pp
            prompt: Prompt = fit_prompt(count, target, f"shardwise-bench-{target}", words_per_token)
            words_per_token = prompt.words_per_token
            if info.method.name == "tokenize":  # the server takes it (context) and bills what was counted
                billed = server.usage_tokens(prompt.text(), required=False)
                if billed is not None and billed != prompt.tokens:
                    notes.append(f"a text counted as {prompt.tokens} tokens was billed {billed} by the server")
            for conc in cfg.concurrency:
                waves, counted = [], []
                for run in range(cfg.runs):
                    texts = [prompt.variant(k + i) for i in range(conc)]
                    k += conc
                    counted.append([count(t) if info.method.name == "tokenize" else prompt.tokens for t in texts])
                    if progress is not None:
                        progress(f"{point_name(cfg.pp, cfg.tg, depth)}, concurrency {conc}"
                                 + (f", run {run + 1} of {cfg.runs}" if cfg.runs > 1 else ""))
                    waves.append(run_wave(server, texts, cfg.tg))
                    if any(not t.token_times for t in waves[-1]):
                        raise ShardwiseError(f"{server.url} ended a stream before its first token "
                                             f"({point_name(cfg.pp, cfg.tg, depth)}, {target}-token prompt)")
                figures = point_figures(waves, counted, info.latency_s)
                flat = [n for wave in counted for n in wave]
                figures["prompt_tokens"].update(target=target, counted_min=min(flat), counted_max=max(flat))
                figures["completion_tokens"]["target"] = cfg.tg
                pred = (predictions or {}).get(depth)
                points.append({"test": point_name(cfg.pp, cfg.tg, depth), "depth": depth, "concurrency": conc,
                               **figures, "prediction": pred, "decode_error": _error(figures, pred, conc)})
    finally:
        server.close()
    return _document(cfg, info, points, notes)


def _error(figures: dict, pred: dict | None, conc: int) -> float | None:
    if pred is None or conc != 1 or not figures["decode_tok_per_s"]:
        return None
    return figures["decode_tok_per_s"] / pred["decode_tok_per_s"] - 1


def _document(cfg: ServingConfig, info: ServerInfo, points: list[dict], notes: list[str]) -> dict:
    lo = min(p["prompt_tokens"]["min"] for p in points)
    hi_off = max(abs(p["prompt_tokens"][k] - p["prompt_tokens"]["target"]) for p in points for k in ("min", "max"))
    exact = hi_off == 0
    source = "server-reported usage.prompt_tokens of every request" if info.stream_usage else (
        f"{info.method.describe()} on every request's text (the server streams no usage)")
    if not info.ignore_eos:
        notes.append("the server refused ignore_eos: a request may stop at EOS before max_tokens (completion_tokens tells)")
    if any(p["completion_tokens"]["min"] < cfg.tg for p in points):
        notes.append("some requests stopped (at EOS) before --tg tokens: decode tok/s counts the tokens they streamed")
    return {
        "kind": "serving-bench", "url": cfg.url, "model": info.model, "endpoint": cfg.endpoint,
        "pp": cfg.pp, "tg": cfg.tg, "depths": list(cfg.depths), "concurrency": list(cfg.concurrency), "runs": cfg.runs,
        "prompt_tokens_method": info.method.describe(),
        "prompt_tokens_exact": exact,
        "prompt_tokens_accuracy": (f"exact: {source}" if exact else
                                   f"within {hi_off} token{'s' if hi_off != 1 else ''} of the target ({source})"),
        "prompt_tokens_min": lo,
        "latency_s": info.latency_s,
        "server": {"models": list(info.models), "stream_usage": info.stream_usage, "ignore_eos_accepted": info.ignore_eos,
                   "tokenize_endpoint": info.method.endpoint},
        "conventions": {
            "prefill_tok_per_s": "prompt tokens (depth + pp) / (TTFT - latency_s, at most half the TTFT off), per "
                                 "request (llama-benchy pp)",
            "decode_tok_per_s": "(completion tokens - 1) / (last token - first token), per request (llama-benchy tg)",
            "*_total_tok_per_s": "all requests of a wave together, over the wave's span",
            "ttft_s": "send to the first chunk with a token", "itl_s": "gaps between streamed chunks with tokens",
            "prediction": "the plan's batch-1 figures at context depth + pp + tg/2 (concurrency is not modelled)",
        },
        "points": points, "notes": notes,
    }
