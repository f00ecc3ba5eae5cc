"""Decode speed at batch 1 on a >= 1 GB checkpoint: shardwise vs transformers vs the memory roofline.

    PYTHONPATH=src python benchmarks/bench_decode.py [--dtype float32|bfloat16] [--prompt 32] [--tokens 32]
        [--threads N] [--rounds 2]

All figures come from this one run on this machine, so the ratios are what to read:

1. **Roofline**: STREAM-like kernels in torch over 256 MB float32 arrays with ``--threads``
   threads, in huge pages where the host gives them (as the loader holds weights:
   ``runtime.hugepages``), best of several passes → GB/s: read (``sum``; also of an array in
   torch's own 4 KB pages, and the better kept), copy and triad ``a = b + s·c``
   (bytes read + written, write-allocate not counted), and the one-row product (``torch.mv``
   and the runtime's ``gemv.mv``, the array as a [16384, 4096] weight) — measured before every
   round and the best of the run kept, because a shared host's bandwidth moves during a run (one
   run here read 25-45 GB/s at different moments, another 33-36 and bursts of 47-62). So each timed
   decode (shardwise tp=1, int8, int4, llama.cpp) is also held against the read bandwidth of its own
   moment (``ReadProbe``: ``sum`` / one-row product over 256 MB, ~0.1 s, just before and just after it,
   the higher kept): each run's share and the best are printed beside the best-sample share. Decode
   streams weights it only reads, so the
   ceiling is the best read bandwidth (``sum`` or a product) over the weight bytes one token reads
   (every layer's weights and the LM head; the embedding reads one row) plus the KV cache it reads at the
   decode's mean context (``cache_bytes``: shardwise's in the run dtype, llama.cpp's in its default F16; < 0.1 %
   at the default prompt, 6 % at 3000 tokens); the triad ceiling is printed next to it.
2. **shardwise tp=1**: ``generate`` in this process (greedy, static KV cache), decode tok/s,
   as shipped (plain one-row GEMVs) and with ``exact=True`` (row-invariant products: the
   compiled fixed-order float32 / AMX bfloat16 kernels of ``runtime.exact``; the numerics
   speculative decoding verifies with and serving runs), to show what that exactness costs.
3. **transformers**: ``LlamaForCausalLM.generate`` on the same safetensors checkpoint, same
   dtype, greedy, ``use_cache``; decode tok/s = (N − 1) / (t(N new tokens) − t(1 new token)).
   Rounds alternate 2 and 3; the best round of each is kept. It runs as users run it: its weights
   in torch's allocator's 4 KB pages (torch asks for huge pages only under ``THP_MEM_ALLOC_ENABLE=1``
   set before start), where shardwise's loader moves its weights into 2 MB pages. Its own share of the
   roofline is printed beside it, and what 1.5x of it would need (where its BLAS streams near the
   machine's bandwidth, as MKL's float32 GEMV does on a Xeon, no runtime can be 1.5x faster).
4. **llama.cpp** (llama-cpp-python, built from source; ``llama_cpp_peer.py``) on the same weights as
   GGUF — F32 as llama.cpp's converter writes it, BF16 / Q8_0 / Q4_0 by llama.cpp's own quantizer —
   same threads: decode tok/s, its bytes per token and share of the roofline, and shardwise's ratio
   at the matching dtype (``--no-llama-cpp`` skips it). A format whose repacked weights crash
   llama.cpp on this machine (tried in a child process first) runs with them off, as its
   ``--no-repack``, and the table says so.
5. **shardwise int8 / int4** (``quantize --format int8`` per channel, ``int4`` groups of 32, with
   ``--lm-head``: the LM head quantized too, as llama.cpp's files hold theirs — Q8_0's in Q8_0, Q4_0's
   in Q6_K; the embedding stays float, one row read per token) at tp=1, activations in ``--dtype``:
   decode tok/s, bytes per token and share of their own roofline, next to llama.cpp's Q8_0 / Q4_0 (bfloat16 rows
   reach the kernel the way this machine measured fastest — as they are, widened, or on integer grids per 32-block:
   ``int_matmul.row_path``; the table says which); and
   ``int8-q8`` / ``int4-q8``: both with ``SHARDWISE_INT_ACTIVATIONS=int8`` (rows rounded to int8 per 32-block in the
   kernel, llama.cpp's own Q8_0 / Q4_0 arithmetic: its ratios are taken against them), where the CPU has AVX-512 VNNI.
6. **shardwise tp=2** (two gloo ranks, ``--threads / 2`` threads each; all-reduce through shared
   memory, ``shm``, in every round right after tp=1 and held against that round's tp=1, and gloo's
   ``builtin`` once) and a traced tp=2 run
   whose per-rank compute / comm / wait shares explain the difference to tp=1.
7. **Targets**: issue #17's, each with its value, "holds" or by how much it is short (roofline shares: the best run's
   against the bandwidth of its own moment, the best sample's beside it).

The checkpoint (llama architecture, hidden 2048, 10 layers, 16 heads / 4 KV heads,
intermediate 5632, vocab 32000, float32: 582 M parameters, 2.3 GB; 1.2 GB loaded as
bfloat16 with ``--dtype bfloat16``, which both runtimes then run in) is written once with
random weights under ``$XDG_CACHE_HOME/shardwise/bench-llama-2048x10``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from pathlib import Path

import torch

from shardwise.runtime.int_matmul import int8_rows_here
from llama_cpp_peer import SHORT_BECAUSE, gguf_token_bytes, llama_cpp_files, llama_cpp_rate, repacks_safely

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 10,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5632,
    "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "initializer_range": 0.02,
}




def checkpoint() -> Path:
    """The benchmark checkpoint, written once (random weights, HF layout via save_pretrained)."""
    from shardwise.runtime.checkpoint import cache_dir

    folder = cache_dir() / "bench-llama-2048x10"
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.float32)
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(staging, safe_serialization=True, max_shard_size="20GB")
    staging.rename(folder)  # a crash mid-write leaves no half checkpoint under the real name
    del model
    gc.collect()
    return folder


def stream_gbps(threads: int, numel: int = 64 * 1024 * 1024, passes: int = 5) -> dict[str, float]:
    """Best-of-``passes`` read (``sum``, of an array in huge pages and of one in 4 KB pages), product read
    (the better of ``torch.mv`` and ``gemv.mv`` over the array as a [numel / 4096, 4096] weight), copy and
    triad bandwidth (GB/s, bytes read + written, no write-allocate)."""
    from shardwise.runtime import gemv, hugepages

    torch.set_num_threads(threads)
    size = numel * 4
    memory = hugepages.arena(3 * size)  # as the loader holds weights; None where the host gives no huge pages
    if memory is None:
        a, b, c = (torch.rand(numel) for _ in range(3))
    else:
        a, b, c = (memory[i * size : (i + 1) * size].view(torch.float32).uniform_() for i in range(3))
    plain = torch.rand(numel)  # in the allocator's own (4 KB) pages
    weight, x = b.view(-1, 4096), torch.rand(4096)
    best = {"read": 0.0, "product": 0.0, "copy": 0.0, "triad": 0.0}
    for _ in range(passes):
        t0 = time.perf_counter()
        plain.sum()
        best["read"] = max(best["read"], size / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        b.sum()
        t1 = time.perf_counter()
        a.copy_(b)
        t2 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        t3 = time.perf_counter()
        best["read"] = max(best["read"], size / (t1 - t0) / 1e9)
        best["copy"] = max(best["copy"], 2 * size / (t2 - t1) / 1e9)
        best["triad"] = max(best["triad"], 3 * size / (t3 - t2) / 1e9)
        for product in (torch.mv, gemv.mv):
            t0 = time.perf_counter()
            product(weight, x)
            best["product"] = max(best["product"], size / (time.perf_counter() - t0) / 1e9)
    return best


class ReadProbe:
    """Read bandwidth (GB/s) of this moment in ~0.1 s: the better of ``sum`` and ``gemv.mv`` over one 256 MB
    float32 array in huge pages (as the loader holds weights; 4 KB pages where the host gives none), best of two
    passes. Taken just before and just after each timed decode (``around``), so that run's share of its
    roofline is held against the bandwidth of its own moment: on a shared host it moves by 2x within a minute
    (this VM: 33-36 GB/s ordinarily, 47-62 in bursts), and the best sample of a run can come from a burst
    no decode saw."""

    def __init__(self, numel: int = 64 * 1024 * 1024):
        from shardwise.runtime import hugepages

        memory = hugepages.arena(numel * 4)
        self.array = torch.rand(numel) if memory is None else memory.view(torch.float32).uniform_()
        self.x = torch.rand(4096)

    def __call__(self) -> float:
        from shardwise.runtime import gemv

        size, weight, best = self.array.numel() * 4, self.array.view(-1, 4096), 0.0
        for _ in range(2):
            for read in (self.array.sum, lambda: gemv.mv(weight, self.x)):
                t0 = time.perf_counter()
                read()
                best = max(best, size / (time.perf_counter() - t0) / 1e9)
        return best


def around(probe: ReadProbe, run) -> tuple[float, float]:
    """(``run()``'s tok/s, the read GB/s of its moment: the higher of ``probe()`` just before and just after)."""
    before = probe()
    rate = run()
    return rate, max(before, probe())


def moment_shares(runs: list[tuple[float, float]], nbytes: int) -> list[float]:
    """Each run's share of the roofline of its own moment: tok/s x ``nbytes`` per token / that moment's GB/s."""
    return [rate * nbytes / (gbps * 1e9) for rate, gbps in runs]


def paired_shares(runs: list[tuple[float, float]], nbytes: int) -> str:
    """Each run's share of the roofline of its own moment (``moment_shares``) and the best of them, as a line's tail."""
    shares = [100 * share for share in moment_shares(runs, nbytes)]
    return (f"{max(shares):.0f}% against the bandwidth of its moment (each run: "
            f"{', '.join(f'{p:.0f}% at {g:.1f} GB/s' for p, (_, g) in zip(shares, runs))})")


def best_of(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per kind, the best GB/s of several ``stream_gbps`` samples."""
    return {k: max(s[k] for s in samples) for k in samples[0]}


def token_bytes(folder: Path, itemsize: int) -> int:
    """Weight bytes one decode token reads at ``itemsize`` bytes per weight: all but the embedding (one row of it)."""
    from shardwise.runtime.loader import load_spec

    embedding = "model.embed_tokens.weight"
    return itemsize * sum(math.prod(t.shape) if t.name != embedding else t.shape[1] for t in load_spec(folder).tensors())


def cache_bytes(prompt: int, tokens: int, itemsize: int) -> int:
    """KV cache bytes one decode token reads, on average over ``tokens`` new tokens after a ``prompt``: every
    layer's keys and values (KV heads x head_dim) at each position before it, ``itemsize`` bytes each."""
    per_position = CONFIG["num_hidden_layers"] * 2 * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * itemsize
    return round((prompt + (tokens + 1) / 2) * per_position)


def shardwise_tp1(folder: Path, prompt: list[int], tokens: int, threads: int, dtype: str,
                  probe: ReadProbe) -> tuple[tuple[float, float], float]:
    """((decode tok/s as shipped (one-row GEMVs), its moment's read GB/s), tok/s with ``exact=True``
    (row-invariant products))."""
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.generate import generate
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    torch.set_num_threads(threads)
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, dtype, max_seq_len=len(prompt) + tokens)
    load_shard(model, folder)
    generate(model, prompt, 4)  # warm-up
    shipped = around(probe, lambda: generate(model, prompt, tokens).decode_tok_per_s)
    blocked = generate(model, prompt, tokens, exact=True).decode_tok_per_s
    del model
    gc.collect()
    return shipped, blocked


def shardwise_int(folder: Path, fmt: str, prompt: list[int], tokens: int, threads: int, dtype: str,
                  probe: ReadProbe) -> tuple[tuple[float, float], int]:
    """((decode tok/s, its moment's read GB/s), weight bytes one token reads) of the checkpoint quantized to
    ``fmt`` (``int8-q8`` / ``int4-q8``: int8 / int4 run with ``SHARDWISE_INT_ACTIVATIONS=int8``), LM head included
    (written once beside the float one), run at tp=1 with ``dtype`` activations."""
    if fmt.endswith("-q8"):
        os.environ["SHARDWISE_INT_ACTIVATIONS"] = "int8"
        try:
            return shardwise_int(folder, fmt.removesuffix("-q8"), prompt, tokens, threads, dtype, probe)
        finally:
            del os.environ["SHARDWISE_INT_ACTIVATIONS"]
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.generate import generate
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM
    from shardwise.runtime.quantize_checkpoint import quantize_checkpoint

    out = folder.with_name(f"{folder.name}-{fmt}-head")
    if not (out / "model.safetensors").exists():
        quantize_checkpoint(folder, out.with_name(out.name + ".partial"), fmt, compare=False, lm_head=True)
        out.with_name(out.name + ".partial").rename(out)
    torch.set_num_threads(threads)
    model = ShardedCausalLM(load_spec(out), ParallelPlan(), 0, getattr(torch, dtype), max_seq_len=len(prompt) + tokens)
    load_shard(model, out)
    embed = model.model.embed_tokens.weight
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    nbytes += embed.shape[1] * embed.element_size()  # one embedding row per token
    generate(model, prompt, 4)  # warm-up
    rate = around(probe, lambda: generate(model, prompt, tokens).decode_tok_per_s)
    del model
    gc.collect()
    return rate, nbytes


def transformers_rate(folder: Path, prompt: list[int], tokens: int, threads: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                       pad_token_id=0, attention_mask=torch.ones_like(ids))
        return time.perf_counter() - t0

    timed(4)  # warm-up
    one, full = timed(1), timed(tokens)
    del model
    gc.collect()
    return (tokens - 1) / (full - one)


def shardwise_tp2(folder: Path, prompt: list[int], tokens: int, threads: int, trace: bool, dtype: str,
                  allreduce: str) -> list[dict]:
    from shardwise.runtime.launch import launch_local
    from shardwise.runtime.runner import RunRequest, run_rank

    request = RunRequest(checkpoint=str(folder), prompt_ids=tuple(prompt), max_new_tokens=tokens, tp=2,
                         threads=threads, trace=trace, dtype=dtype, allreduce=allreduce)
    return launch_local(run_rank, 2, args=(request,), run_timeout_s=3600)


def verdicts(label: str, measured: dict[str, tuple[float, float, str]]) -> list[str]:
    """Issue #17's targets as this run measured them: for each name, (value, target, a note) — 'holds', or by how much
    it is short."""
    lines = [f"targets (issue #17), {label}; roofline shares are the best run's against the bandwidth of its own moment:"]
    for name, (value, target, note) in measured.items():
        verdict = "holds" if value >= target else f"short by {100 * (1 - value / target):.1f}%"
        lines.append(f"  {name:30s} {value:5.2f} (target {target:g}): {verdict}{note}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and activations")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads at tp=1 (tp=2: half per rank)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (llama-cpp-python) at F32/BF16/Q8_0/Q4_0")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of shardwise tp=1 and transformers")
    args = parser.parse_args()
    folder = checkpoint()
    prompt = [(7 * i + 3) % CONFIG["vocab_size"] for i in range(args.prompt)]
    itemsize = 2 if args.dtype == "bfloat16" else 4
    kv_bytes = cache_bytes(args.prompt, args.tokens, itemsize)  # shardwise's cache, in the run dtype
    weight_bytes = token_bytes(folder, itemsize) + kv_bytes
    samples = [stream_gbps(args.threads)]
    ggufs = {} if args.no_llama_cpp else llama_cpp_files(folder)
    ours: list[tuple[float, float]] = []  # (tok/s, GB/s of its moment) per round
    exact, theirs = [], []
    peer: dict[str, list[tuple[float, float]]] = {fmt: [] for fmt in ggufs}
    unrepacked = {fmt for fmt, path in ggufs.items() if not repacks_safely(path, prompt, args.tokens, args.threads)}
    q8 = int8_rows_here()  # where int8 rows (int_matmul.activations) run
    ints: dict[str, list[tuple[float, float]]] = {"int8": [], "int4": []} | ({"int8-q8": [], "int4-q8": []} if q8 else {})
    int_bytes: dict[str, int] = {}
    probe, half = ReadProbe(), max(1, args.threads // 2)
    shm: list[float] = []  # tp=2 (--allreduce shm) tok/s per round, run right after that round's tp=1
    # one-thread ranks measure their kernel choices on first use (once per build of the kernels): not in a timed round
    shardwise_tp2(folder, prompt, 2, half, False, args.dtype, "shm")
    for i in range(args.rounds):
        if i:
            samples.append(stream_gbps(args.threads))
        shipped, blocked = shardwise_tp1(folder, prompt, args.tokens, args.threads, args.dtype, probe)
        ours.append(shipped)
        exact.append(blocked)
        shm.append(shardwise_tp2(folder, prompt, args.tokens, half, False, args.dtype, "shm")[0]["tok_per_s"])
        theirs.append(transformers_rate(folder, prompt, args.tokens, args.threads, args.dtype))
        for fmt in ints:
            timed, nbytes = shardwise_int(folder, fmt, prompt, args.tokens, args.threads, args.dtype, probe)
            int_bytes[fmt] = nbytes + kv_bytes
            ints[fmt].append(timed)
        for fmt, path in ggufs.items():
            peer[fmt].append(llama_cpp_rate(path, prompt, args.tokens, args.threads, lambda run: around(probe, run),
                                            fmt not in unrepacked))
    tp2 = {"builtin": shardwise_tp2(folder, prompt, args.tokens, half, False, args.dtype, "builtin")[0]["tok_per_s"],
           "shm": max(shm)}
    traced = shardwise_tp2(folder, prompt, min(args.tokens, 12), half, True, args.dtype, "shm")
    best, padded, hf = max(rate for rate, _ in ours), max(exact), max(theirs)
    bw = best_of(samples)
    read = max(bw["read"], bw["product"])
    ceiling = read * 1e9 / weight_bytes
    print(f"llama 2048x10 {args.dtype}, {weight_bytes / 1e9:.2f} GB read per token (KV cache included), "
          f"prompt {args.prompt}, tg{args.tokens}, {args.threads} thread(s)")
    spread = ", ".join(f"{max(s['read'], s['product']):.1f}" for s in samples)
    print(f"memory bandwidth (best of {len(samples)} samples: {spread}): read {bw['read']:.1f} GB/s, one-row product "
          f"{bw['product']:.1f}, copy {bw['copy']:.1f}, triad {bw['triad']:.1f} -> roofline {ceiling:.2f} tok/s "
          f"(triad: {bw['triad'] * 1e9 / weight_bytes:.2f}); each decode's own moment: ReadProbe just before and after")
    from shardwise.runtime import gemv

    torch.set_num_threads(args.threads)
    from shardwise.runtime import int_matmul

    products = {"torch_mv": "torch.mv", "kernel": "the compiled kernel, one weight row at a time",
                "kernel_pairs": "the compiled kernel, two weight rows at a time"}[gemv.chosen_name(getattr(torch, args.dtype))]

    def row_path(fmt: str) -> str:
        """How the int kernel takes this run's rows here (this machine's measured choice)."""
        bits = 8 if fmt.startswith("int8") else 4
        if fmt.endswith("-q8"):
            two = ", two weight rows at a time (this machine's measured choice)" if int_matmul.q8_pairs(bits) else ""
            return (f" rounded to int8 per 32-block in the kernel (SHARDWISE_INT_ACTIVATIONS=int8: llama.cpp's "
                    f"{'Q8_0' if bits == 8 else 'Q4_0'} arithmetic{two})")
        path = int_matmul.row_path(bits) if args.dtype == "bfloat16" else int_matmul.float_path(bits)
        how = {"bfloat16": "as they are (vdpbf16ps)", "float32": "as float32",
               "int16": "on 15-bit integer grids per 32-block (vpdpbusd)",
               "int24": "on 23-bit integer grids per 32-block (vpdpbusd)"}[path.removesuffix("_pairs")]
        return f" ({how}{', two weight rows at a time,' if path.endswith('_pairs') else ''} in the kernel: this machine's measured choice)"

    print(f"shardwise tp=1   {best:6.2f} tok/s  (rounds {', '.join(f'{x:.2f}' for x, _ in ours)}), as shipped "
          f"(one-row products: {products}, this machine's measured choice)")
    print(f"  exact=True     {padded:6.2f} tok/s  (rounds {', '.join(f'{x:.2f}' for x in exact)}), row-invariant products")
    print(f"transformers     {hf:6.2f} tok/s  (rounds {', '.join(f'{x:.2f}' for x in theirs)}; {100 * hf / ceiling:.0f}% of the "
          f"best sample's roofline: 1.5x transformers would be {150 * hf / ceiling:.0f}% of it)")
    print(f"shardwise / transformers = {best / hf:.2f}x ({padded / hf:.2f}x with exact=True); "
          f"shardwise / roofline = {100 * best / ceiling:.0f}% of the best sample's ({100 * padded / ceiling:.0f}%), "
          f"{paired_shares(ours, weight_bytes)}")
    for fmt, runs in ints.items():
        rates = [rate for rate, _ in runs]
        print(f"shardwise {fmt:7s} {max(rates):6.2f} tok/s  ({int_bytes[fmt] / 1e9:.2f} GB per token, "
              f"{100 * max(rates) * int_bytes[fmt] / (read * 1e9):.0f}% of the best sample's roofline, "
              f"{paired_shares(runs, int_bytes[fmt])}), {args.dtype} activations{row_path(fmt)}")
    dtype_of = {"F32": "float32", "BF16": "bfloat16"}  # llama.cpp formats shardwise runs too
    int_of = {"Q8_0": "int8-q8", "Q4_0": "int4-q8"} if q8 else {"Q8_0": "int8", "Q4_0": "int4"}  # llama.cpp rounds rows to Q8_0
    def share(runs: list[tuple[float, float]], nbytes: int, target: float) -> tuple[float, float, str]:
        """(the best run's share of its moment's roofline, ``target``, the best sample's share as a note)."""
        return max(moment_shares(runs, nbytes)), target, (
            f" ({max(rate for rate, _ in runs) * nbytes / (read * 1e9):.2f} of the best sample's)")

    targets = {f"{args.dtype} tp=1 / transformers": (best / hf, 1.5, ""),
               f"{args.dtype} tp=1 / roofline": share(ours, weight_bytes, 0.65)}
    targets |= {f"{fmt} / its roofline": share(runs, int_bytes[fmt], 0.6) for fmt, runs in ints.items()}
    for fmt, runs in peer.items():
        nbytes, rate = gguf_token_bytes(ggufs[fmt]) + cache_bytes(args.prompt, args.tokens, 2), max(r for r, _ in runs)
        if dtype_of.get(fmt) == args.dtype:
            versus = f"shardwise {args.dtype} / llama.cpp = {best / rate:.2f}x"
            targets[f"{args.dtype} / llama.cpp {fmt}"] = (best / rate, 1.0, "")
        elif fmt in dtype_of:
            versus = f"shardwise at {fmt}: run --dtype {dtype_of[fmt]}"
        else:
            ratio = max(r for r, _ in ints[int_of[fmt]]) / rate
            targets[f"{int_of[fmt]} / llama.cpp {fmt}"] = (ratio, 1.0, "")
            versus = f"shardwise {int_of[fmt]} / llama.cpp = {ratio:.2f}x" + (f" ({SHORT_BECAUSE})" if ratio < 1 else "")
        crashed = " [--no-repack: its repacked weights crashed llama.cpp here (repacks_safely)]" if fmt in unrepacked else ""
        print(f"llama.cpp {fmt:5s} {rate:6.2f} tok/s  ({nbytes / 1e9:.2f} GB per token, "
              f"{100 * rate * nbytes / (read * 1e9):.0f}% of the best sample's roofline, {paired_shares(runs, nbytes)}); "
              f"{versus}{crashed}")
    print(f"shardwise tp=2   {tp2['builtin']:6.2f} tok/s  ({half} thread(s) per rank, --allreduce builtin) = "
          f"{tp2['builtin'] / best:.2f}x tp=1")
    print(f"shardwise tp=2   {tp2['shm']:6.2f} tok/s  ({half} thread(s) per rank, --allreduce shm; rounds "
          f"{', '.join(f'{x:.2f}' for x in shm)}) = {tp2['shm'] / best:.2f}x tp=1; each round against that round's "
          f"tp=1, run just before it: {', '.join(f'{x / t:.2f}x' for x, (t, _) in zip(shm, ours))}")
    targets["tp=2 (shm) / tp=1"] = (tp2["shm"] / best, 0.85, "")
    print("\n".join(verdicts(f"{args.dtype}, {args.threads} thread(s)", targets)))
    from shardwise.runtime.trace import summarize

    summary = summarize([r["trace"] for r in traced], "bench-llama-2048x10", 2, 1, traced[0]["tok_per_s"])
    print("traced tp=2 decode step (--allreduce shm), per rank (ms, share of step):")
    for r in summary["ranks"]:
        step = r["step_s"]
        parts = ", ".join(f"{k[:-2]} {r[k] * 1e3:.1f} ({100 * r[k] / step:.0f}%)"
                          for k in ("compute_s", "comm_s", "wait_s", "sync_s", "other_s"))
        print(f"  rank {r['rank']}: step {step * 1e3:.1f} ms = {parts}")
    print(json.dumps({"roofline_tok_per_s": ceiling, "bandwidth_gbps": bw, "bandwidth_samples": samples, "shardwise_tp1": best,
                      "shardwise_tp1_runs": ours, "shardwise_tp1_exact": padded, "transformers": hf, "shardwise_tp2": tp2, "shardwise_tp2_shm_runs": shm,
                      "shardwise_int": ints, "int_token_bytes": int_bytes,
                      "llama_cpp": peer, "llama_cpp_no_repack": sorted(unrepacked), "trace_ranks": summary["ranks"]}))


if __name__ == "__main__":
    main()
