"""`shardwise serve` under load: aggregate and per-request decode tok/s and TTFT per concurrency.

    PYTHONPATH=src python benchmarks/bench_serve.py [--models dense,moe] [--tp 1,2] [--concurrency 1,2,4,8,16]
        [--requests 32] [--max-tokens 32] [--prompt-tokens 64] [--checkpoint DIR] [--backend gloo|nccl]
        [--out bench_serve.json]

For each model and tp a server is started as a user starts it (``shardwise serve CHECKPOINT --tp TP
--max-batch 16`` on a free loopback port), warmed up with one request, then at each
concurrency C, ``--requests`` streamed ``/v1/completions`` are sent by C clients that each send
the next request as soon as their last one ends (so C are in flight until the queue runs dry).
Every prompt is ``--prompt-tokens`` token ids, distinct per request (no two share a first
token), ``temperature=0``, ``max_tokens=--max-tokens``, ``ignore_eos: true`` (vLLM's field: the
server generates exactly ``max_tokens`` whatever the model says), ``stream_options.include_usage``;
the tokens a request made are its ``usage.completion_tokens``. Timing is ``shardwise bench --url``'s
(``measure.serving_client``): per request, TTFT = send to the first chunk that carries a token
and decode tok/s = (tokens - 1) / (last token chunk - first token chunk). Per level:

- aggregate tok/s: all tokens generated at that level / the level's wall time (first send to
  last answer);
- per-request decode tok/s: the median over the level's requests;
- TTFT p50 / p99 (linear interpolation between the order statistics);
- batch/step: generated tokens / server steps over the level (``/metrics``), the mean number of
  sequences each step advanced — continuous batching at work, or not.

Two checkpoints (``--models``, both by default), each written once with random weights by
``runtime.checkpoint.make_checkpoint`` (the tiny scale widened through its overrides) under
``$XDG_CACHE_HOME/shardwise/``:

- **dense** (``bench-serve-llama-2048x8-v2``): Llama layout, hidden 2048, 8 layers, 16 heads x 128
  / 4 KV heads, MLP width 5632, vocab 512, float32: 363 M parameters, 1.45 GB;
- **moe** (``bench-serve-qwen3moe-1024x4-v2``): Qwen3-MoE layout, hidden 1024, 4 layers, 8 heads x
  128 / 4 KV heads, 64 experts of width 384, top-8, vocab 512, float32: 316 M parameters, 1.26 GB.

**Target** (dense): aggregate tok/s at concurrency 8 >= 4x concurrency 1 (checked when both are
run). Decode is bandwidth-bound: a step reads each weight once for all the sequences it advances,
so 8 sequences in a batch cost little more than one.

The moe model is not held to that target: a mixture-of-experts layer reads the union of the
experts its batch routes to, so the ``union`` column gives, per level, the bound on that ratio if
decode only streamed weights: C x (bytes one token reads) / (bytes a C-token step reads), the
experts touched by C uniformly routed tokens expected (the router of random weights is close to
uniform). With 64 experts top-8 that bound is about 1.9x at concurrency 8, below 4x, so its line
reads "target vs union bound": the ratio measured beside the bound and the share of it reached,
no pass or failure.

In both checkpoints the ``lm_head`` rows of the 128 byte tokens that are no whole UTF-8
character are zeroed: their logit is 0 while the largest of the ~380 others is > 0 for any
hidden state, so greedy decoding never picks one and every token (special ids aside, below)
streams as a chunk of its own (the server holds back an unfinished character's bytes: a random
model that repeats one such byte would stream nothing until its end, and its TTFT would read as
its whole duration). The end-of-sequence rows are left as they are (``ignore_eos`` carries a
request past them); an EOS or other special id (5 of the 512) decodes to no text, so it streams
no chunk, though usage counts it.
The ``-v2`` folders replace the earlier ones, whose EOS rows were zeroed too.

With ``--checkpoint DIR`` that folder alone is served (``--models`` is ignored) and nothing in it
is changed: every request still makes ``--max-tokens``, but a token whose text is held back streams
no chunk. Its target line is the 4x target, or "vs union bound" when its config routes experts.

Other processes skew everything: the load average is printed before and after each tp;
run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from shardwise.measure.serving_client import Server, ServingConfig, Timing  # noqa: E402

MODELS = {  # --models name: (catalog key, cache folder, config overrides of the tiny scale)
    "dense": ("llama-3.1-8b", "bench-serve-llama-2048x8-v2",
              dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, head_dim=128, num_key_value_heads=4,
                   intermediate_size=5632, vocab_size=512)),
    "moe": ("qwen3-30b-a3b", "bench-serve-qwen3moe-1024x4-v2",
            dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, head_dim=128, num_key_value_heads=4,
                 num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, max_window_layers=4)),
}
MAX_BATCH = 16
READY_S = 600.0
TARGET = (8, 1, 4.0)  # aggregate tok/s at concurrency 8 >= 4x concurrency 1


def checkpoint(model: str) -> Path:
    """The benchmark checkpoint of ``model``, written once (random weights, the lm_head rows of the
    byte tokens that are no whole character zeroed)."""
    from safetensors.torch import load_file, save_file

    from shardwise.runtime.checkpoint import cache_dir, make_checkpoint

    key, name, overrides = MODELS[model]
    folder = cache_dir() / name
    if (folder / "model.safetensors").exists() and (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    print(f"writing the {model} benchmark checkpoint to {folder} (once)", flush=True)
    make_checkpoint(key, "tiny", staging, seed=0, overrides=overrides)
    tensors = load_file(str(staging / "model.safetensors"))
    tensors["lm_head.weight"][sorted(partial_chars(staging))] = 0.0
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    staging.rename(folder)  # a crash mid-write leaves no half checkpoint under the real name
    return folder


def eos_ids(folder: Path) -> set[int]:
    """Every id the server stops on without ``ignore_eos`` (config and generation config EOS, the
    tokenizer's <|eos|> and the ChatML <|im_end|>)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            value = json.loads((folder / name).read_text()).get("eos_token_id")
            ids |= set(value) if isinstance(value, list) else ({value} if isinstance(value, int) else set())
    added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
    ids |= {t["id"] for t in added if t["content"] in ("<|eos|>", "<|im_end|>")}
    return ids


def partial_chars(folder: Path) -> set[int]:
    """Ids that decode to no whole UTF-8 character (the byte tokens 0x80..0xff): the server holds
    their text back until a later token completes it, so they would stream no chunk of their own."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return {i for i in range(tok.get_vocab_size()) if "\ufffd" in tok.decode([i])}


def special_ids(folder: Path) -> set[int]:
    """Ids kept out of the prompts: the tokenizer's added tokens (BOS, EOS, pad, ChatML) and EOS."""
    added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
    return eos_ids(folder) | {t["id"] for t in added}


def expert_bound(folder: Path, concurrency: int) -> float | None:
    """C x bytes(1 token) / bytes(a C-token step) with uniform routing (None: not a routed MoE)."""
    config = json.loads((folder / "config.json").read_text())
    experts, top_k = config.get("num_experts"), config.get("num_experts_per_tok")
    if not experts or not top_k:
        return None
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config.get("head_dim", 128)
    attn = h * hd * (2 * heads + 2 * kv)
    expert = 3 * h * config["moe_intermediate_size"]
    head = config["vocab_size"] * h

    def step(c: int) -> float:
        union = experts * (1 - (1 - top_k / experts) ** c)
        return layers * (attn + union * expert) + head

    return concurrency * step(1) / step(concurrency)


# ------------------------------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


class ServeProcess:
    """``shardwise serve`` on a free port; its stderr in a temporary log printed on failure."""

    def __init__(self, folder: Path, tp: int, max_model_len: int, backend: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False)
        argv = [sys.executable, "-m", "shardwise", "serve", str(folder), "--tp", str(tp), "--max-batch",
                str(MAX_BATCH), "--max-model-len", str(max_model_len), "--port", str(self.port), "--backend", backend]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log, env=env, start_new_session=True)
        deadline = time.monotonic() + READY_S
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"shardwise serve exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"shardwise serve not ready in {READY_S:g} s:\n{self.tail()}")
            try:
                get(self.url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.3)

    def tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text().splitlines()[-lines:])

    def metric(self, name: str) -> float:
        match = re.search(rf"^{re.escape(name)} (\S+)$", get(self.url + "/metrics"), re.M)
        return float(match.group(1)) if match else 0.0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


class IdPrompts(Server):
    """``serving_client.Server`` sending a prompt of token ids (``/v1/completions`` takes a list)."""

    def body(self, prompt, max_tokens: int, stream: bool) -> dict:
        body = super().body("", max_tokens, stream)
        body["prompt"] = list(prompt)
        return body


# ------------------------------------------------------------------------------------ measuring


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def prompts(count: int, length: int, vocab: int, skip: set[int], offset: int) -> list[list[int]]:
    """``count`` prompts of ``length`` ids: request i starts at a different id and walks the vocabulary."""
    usable = [t for t in range(vocab) if t not in skip]
    return [[usable[(offset + i + 7 * j) % len(usable)] for j in range(length)] for i in range(count)]


def level(server: Server, serve: ServeProcess, concurrency: int, batch: list[list[int]], max_tokens: int) -> dict:
    tokens0, steps0 = serve.metric("shardwise_generation_tokens_total"), serve.metric("shardwise_steps_total")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        timings: list[Timing] = list(pool.map(lambda p: server.stream(p, max_tokens), batch))
    wall = time.perf_counter() - start
    tokens1, steps1 = serve.metric("shardwise_generation_tokens_total"), serve.metric("shardwise_steps_total")
    made = [t.completion_tokens or 0 for t in timings]
    ttft = [t.token_times[0] - t.sent for t in timings if t.token_times]
    decode = [(n - 1) / (t.token_times[-1] - t.token_times[0])
              for t, n in zip(timings, made) if n > 1 and len(t.token_times) > 1 and t.token_times[-1] > t.token_times[0]]
    return {
        "concurrency": concurrency, "requests": len(batch), "wall_s": wall, "tokens": sum(made),
        "short_requests": sum(n < max_tokens for n in made),
        "aggregate_tok_per_s": sum(made) / wall,
        "request_decode_tok_per_s_p50": statistics.median(decode) if decode else None,
        "ttft_s_p50": percentile(ttft, 0.5) if ttft else None,
        "ttft_s_p99": percentile(ttft, 0.99) if ttft else None,
        "batch_per_step": (tokens1 - tokens0) / (steps1 - steps0) if steps1 > steps0 else None,
    }


def run_tp(label: str, folder: Path, tp: int, args, vocab: int, skip: set[int]) -> list[dict]:
    max_len = args.prompt_tokens + args.max_tokens + 8
    load = os.getloadavg()[0]
    print(f"\n{label} tp={tp}: starting shardwise serve ({folder.name}, --max-batch {MAX_BATCH}, "
          f"--max-model-len {max_len}, --backend {args.backend}); load average {load:.2f}", flush=True)
    serve = ServeProcess(folder, tp, max_len, args.backend)
    rows: list[dict] = []
    width = max(5, len(label))
    try:
        model = json.loads(get(serve.url + "/v1/models"))["data"][0]["id"]
        cfg = ServingConfig(url=serve.url + "/v1", model=model, endpoint="completions", timeout_s=args.timeout)
        server = IdPrompts(cfg, connections=max(args.concurrency))
        server.extras = {"stream_options": {"include_usage": True}, "ignore_eos": True}
        try:
            server.stream(prompts(1, args.prompt_tokens, vocab, skip, 1000)[0], 4)  # warm-up
            print(f"{'model':>{width}s} {'conc':>4s} {'reqs':>4s} {'tokens':>6s} {'wall s':>7s} {'agg tok/s':>9s} "
                  f"{'req tok/s':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'batch/step':>10s} {'union':>6s}")
            for i, c in enumerate(args.concurrency):
                row = level(server, serve, c, prompts(args.requests, args.prompt_tokens, vocab, skip, i * args.requests),
                            args.max_tokens)
                row["model"], row["tp"], row["expert_bound"] = label, tp, expert_bound(folder, c)
                rows.append(row)
                fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
                union = f"{row['expert_bound']:5.2f}x" if row["expert_bound"] is not None else f"{'-':>6s}"
                print(f"{label:>{width}s} {c:4d} {row['requests']:4d} {row['tokens']:6d} {row['wall_s']:7.2f} "
                      f"{row['aggregate_tok_per_s']:9.1f} {fmt(row['request_decode_tok_per_s_p50'], '9.1f')} "
                      f"{fmt(row['ttft_s_p50'] and row['ttft_s_p50'] * 1e3, '7.0f')} ms "
                      f"{fmt(row['ttft_s_p99'] and row['ttft_s_p99'] * 1e3, '7.0f')} ms "
                      f"{fmt(row['batch_per_step'], '10.2f')} {union}"
                      + (f"  ({row['short_requests']} ended before --max-tokens)" if row["short_requests"] else ""),
                      flush=True)
        finally:
            server.close()
    finally:
        code = serve.stop()
        print(f"{label} tp={tp}: server exited {code}; load average {os.getloadavg()[0]:.2f}", flush=True)
    return rows


def target(rows: list[dict]) -> list[dict]:
    """Per model and tp with both concurrencies run: the ratio, checked against the 4x target for a
    dense model (``met``), set beside the union bound for a routed MoE (``of_bound``, ``met`` None)."""
    high, low, ratio = TARGET
    out = []
    for model, tp in dict.fromkeys((r["model"], r["tp"]) for r in rows):
        by = {r["concurrency"]: r for r in rows if r["model"] == model and r["tp"] == tp}
        if high in by and low in by:
            got = by[high]["aggregate_tok_per_s"] / by[low]["aggregate_tok_per_s"]
            bound = by[high]["expert_bound"]
            out.append({"model": model, "tp": tp, "ratio": got, "expert_bound": bound,
                        "checked_against": "target" if bound is None else "union bound",
                        "met": got >= ratio if bound is None else None,
                        "of_bound": got / bound if bound is not None else None})
    return out


def counts(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} '{text}' must be comma-separated integers >= 1")
    return list(dict.fromkeys(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe", help=f"benchmark checkpoints, of {','.join(MODELS)}")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, e.g. 1,2")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="clients in flight, e.g. 1,2,4,8,16")
    parser.add_argument("--requests", type=int, default=32, help="streamed requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt token ids per request")
    parser.add_argument("--checkpoint", type=Path, help="serve this checkpoint folder alone (--models ignored)")
    parser.add_argument("--backend", default="gloo", help="passed to shardwise serve (gloo or nccl)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    tps, args.concurrency = counts(args.tp, "--tp"), counts(args.concurrency, "--concurrency")
    if max(args.concurrency) > MAX_BATCH:
        print(f"note: concurrency above --max-batch {MAX_BATCH} queues requests for a slot")
    if args.requests < 1 or args.max_tokens < 2 or args.prompt_tokens < 1:
        raise SystemExit("--requests must be >= 1, --max-tokens >= 2, --prompt-tokens >= 1")
    if args.checkpoint:
        models = [args.checkpoint.name]
    else:
        models = list(dict.fromkeys(m.strip() for m in args.models.split(",") if m.strip()))
        if not models or set(models) - set(MODELS):
            raise SystemExit(f"--models '{args.models}' must be comma-separated names of {', '.join(MODELS)}")
    print(f"prompts of {args.prompt_tokens} ids, max_tokens {args.max_tokens} (ignore_eos), temperature 0, "
          f"{args.requests} requests per level, {os.cpu_count()} CPUs")
    rows: list[dict] = []
    checkpoints: dict[str, dict] = {}
    for label in models:
        folder = args.checkpoint or checkpoint(label)
        config = json.loads((folder / "config.json").read_text())
        config = config.get("text_config", config)
        vocab = min(config["vocab_size"], len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]))
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        checkpoints[label] = {"checkpoint": str(folder), "checkpoint_bytes": size}
        print(f"\n{label}: {folder} ({size / 1e9:.2f} GB of safetensors)", flush=True)
        for tp in tps:
            rows += run_tp(label, folder, tp, args, vocab, special_ids(folder))
    verdicts = target(rows)
    high, low, ratio = TARGET
    print()
    for v in verdicts:
        if v["checked_against"] == "target":
            print(f"target ({v['model']}, tp={v['tp']}): aggregate tok/s at concurrency {high} >= {ratio:g}x "
                  f"concurrency {low}: {v['ratio']:.2f}x, {'met' if v['met'] else 'NOT met'}")
        else:
            print(f"target vs union bound ({v['model']}, tp={v['tp']}): aggregate tok/s at concurrency {high} / "
                  f"concurrency {low}: {v['ratio']:.2f}x vs the weight-streaming bound {v['expert_bound']:.2f}x "
                  f"({v['of_bound']:.0%} of it; the {ratio:g}x target is the dense model's)")
    if not verdicts:
        print(f"target: aggregate tok/s at concurrency {high} >= {ratio:g}x concurrency {low} "
              f"(run both concurrencies to check it)")
    if args.out:
        doc = {"checkpoints": checkpoints, "max_batch": MAX_BATCH, "prompt_tokens": args.prompt_tokens,
               "max_tokens": args.max_tokens, "ignore_eos": True, "requests": args.requests,
               "backend": args.backend, "cpus": os.cpu_count(), "levels": rows,
               "target": {"concurrency": high, "baseline": low, "ratio": ratio, "results": verdicts}}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
