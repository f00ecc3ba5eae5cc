"""Hybrid linear-attention MoE decode at tp=1: shardwise vs transformers, and per layer kind where a step goes.

    PYTHONPATH=src python benchmarks/bench_hybrid.py [--model both|qwen3.5|kimi-linear] [--hidden 1024]
        [--layers 8] [--prompt 32] [--tokens 64] [--threads N] [--rounds 3] [--dtype float32|bfloat16]
        [--trace-out DIR] [--profile N]

On demand, not a test. For each family (Qwen3.5-MoE: Gated DeltaNet + gated attention;
Kimi Linear: KDA + NoPE MLA), all figures from this one run on this machine:

1. **Checkpoint**: ``runtime.checkpoint.make_checkpoint`` at the ``small`` scale of
   ``qwen3.5-397b-a17b`` / ``kimi-linear-48b-a3b`` (every layer kind, every fourth layer full
   attention), widened through its ``overrides`` to ``--hidden`` (default 1024) and ``--layers``
   (default 8) with the real models' head shapes (d_k = d_v = 128; Qwen3.5's gated attention
   head_dim 256, 2 KV heads; Kimi's NoPE MLA with q/k 128 + 64, v 128, kv_lora_rank hidden / 4,
   a dense first layer of 4 · hidden),
   16 routed experts top-4 of width hidden / 4 and a shared expert. The plain ``small`` scale
   is ~40 MB; the defaults write ~0.7 GB of float32 (printed). Written once under
   ``$XDG_CACHE_HOME/shardwise/bench-hybrid-<model>-<hidden>x<layers>``.
2. **tg<N> @ d<P>** (llama-bench's name: N tokens generated after a P-token prompt): decode tok/s
   of shardwise ``generate`` (tp=1, in this process) and of transformers' ``generate`` on the
   same safetensors, same dtype and threads, greedy, EOS off on both sides so both make exactly
   N tokens. shardwise: (N − 1) / decode seconds (prefill and first token excluded);
   transformers: (N − 1) / (t(N new tokens) − t(1 new token)), as ``bench_decode.py``. A
   warm-up generate first on each side; rounds alternate the two, the best round of each kept.
   The greedy tokens of both are compared (the runtime is exact against transformers in float32;
   random weights can still flip a near-tie after many steps).
3. **Per layer kind**: one more shardwise generate with the per-layer trace (``runtime.trace.
   Tracer``, what ``shardwise run --trace`` attaches) and one transformers generate with timing
   hooks on its decoder layers; mean decode-step compute per layer, split at the same boundaries:
   the mixer block (input norm + token mixer: DeltaNet / KDA vs attention) and the MLP block
   (residual, post norm, MoE or dense MLP), plus the rest of the step (embedding, final norm,
   LM head, pick). ``--trace-out DIR`` also writes the Chrome trace and its summary there.
4. ``--profile N``: inside shardwise's DeltaNet / KDA layers, ms per decode step of the
   compiled step (``linear_state.fused_step``: conv + recurrence; else the recurrence and the
   short conv apart) and the state snapshots (the module functions wrapped with a clock;
   numerics untouched), then torch.profiler's top ops over N decode steps (prefill excluded).

Other processes on the machine skew everything (best-of-rounds only helps so far): the load
average is printed before and after each model; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import time
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from hybrid_transformers import transformers_blocks, transformers_rate

MODELS = {"qwen3.5": "qwen3.5-397b-a17b", "kimi-linear": "kimi-linear-48b-a3b"}
HEAD = 128  # d_k = d_v of DeltaNet / KDA heads, as the real models
EXPERTS, TOP_K = 16, 4  # the small scale's routed experts


def _catalog(model_key: str) -> dict[str, Any]:
    return json.loads(resources.files("shardwise.spec.catalog.models").joinpath(f"{model_key}.json").read_text())


def overrides(model: str, hidden: int, layers: int) -> dict[str, Any]:
    """``make_checkpoint`` overrides widening the ``small`` scale to ``hidden`` × ``layers`` (full
    attention at every fourth layer, as the real models and the small scale)."""
    if hidden % 256:
        raise SystemExit(f"--hidden {hidden}: use a multiple of 256 (heads of {HEAD} channels, experts of hidden/4)")
    full = [i for i in range(1, layers + 1) if i % 4 == 0]
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_experts=EXPERTS, moe_intermediate_size=hidden // 4)
    if model == "qwen3.5":
        from shardwise.runtime.checkpoint import shrink_config

        rope = shrink_config(_catalog(MODELS[model]), "small")["text_config"]["rope_parameters"]
        return dict(
            common, num_experts_per_tok=TOP_K, shared_expert_intermediate_size=hidden // 4,
            num_attention_heads=hidden // 128, head_dim=256, num_key_value_heads=2,  # q|gate: 2·hidden wide
            linear_num_key_heads=hidden // 256, linear_num_value_heads=hidden // 64,
            linear_key_head_dim=HEAD, linear_value_head_dim=HEAD,
            layer_types=["full_attention" if i in full else "linear_attention" for i in range(1, layers + 1)],
            rope_parameters={**rope, "mrope_section": [11, 11, 10]},  # head_dim 256 · 0.25 rotary = 32 pairs
        )
    lac = {**_catalog(MODELS[model])["linear_attn_config"], "head_dim": HEAD, "num_heads": hidden // HEAD,
           "full_attn_layers": full, "kda_layers": [i for i in range(1, layers + 1) if i not in full]}
    return dict(
        common, num_experts_per_token=TOP_K, intermediate_size=4 * hidden, linear_attn_config=lac,
        head_dim=HEAD, num_attention_heads=hidden // HEAD, num_key_value_heads=hidden // HEAD,
        kv_lora_rank=hidden // 4, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    )


def checkpoint(model: str, hidden: int, layers: int) -> Path:
    """The benchmark checkpoint, written once (random weights, float32, Hugging Face layout)."""
    from shardwise.runtime.checkpoint import cache_dir, make_checkpoint

    folder = cache_dir() / f"bench-hybrid-{model}-{hidden}x{layers}"
    if (folder / "model.safetensors").exists() and (folder / "config.json").exists():
        return folder
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    make_checkpoint(MODELS[model], "small", staging, seed=0, overrides=overrides(model, hidden, layers))
    staging.rename(folder)  # a crash mid-write leaves no half checkpoint under the real name
    gc.collect()
    return folder


def sizes(folder: Path, dtype: torch.dtype) -> dict[str, Any]:
    from shardwise.runtime.loader import load_spec

    spec = load_spec(folder)
    kinds: dict[str, int] = {}
    for layer in spec.layers:
        kinds[layer.attention] = kinds.get(layer.attention, 0) + 1
    return {
        "file_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
        "params": spec.total_params,
        "active_params": spec.active_params,
        "token_bytes": spec.active_params * torch.tensor([], dtype=dtype).element_size(),
        "layer_kinds": kinds,
        "kinds": [layer.attention for layer in spec.layers],
        "mlps": [layer.mlp for layer in spec.layers],
        "vocab": spec.vocab_size,
    }


# ----------------------------------------------------------------------------- shardwise


def _shardwise_model(folder: Path, dtype: str, max_seq_len: int):
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, dtype, max_seq_len=max_seq_len)
    load_shard(model, folder)
    return model


def shardwise_tp1(folder: Path, prompt: list[int], tokens: int, threads: int, dtype: str) -> tuple[float, list[int]]:
    """Decode tok/s (after a warm-up) and the greedy tokens."""
    from shardwise.runtime.generate import generate

    torch.set_num_threads(threads)
    model = _shardwise_model(folder, dtype, len(prompt) + tokens)
    generate(model, prompt, 4, eos=set())  # warm-up
    result = generate(model, prompt, tokens, eos=set())
    del model
    gc.collect()
    return result.decode_tok_per_s, result.tokens


def _block_times(export: dict[str, Any]) -> tuple[dict[tuple[int, str], float], float, int]:
    """From one rank's trace export: mean compute seconds per (layer, block) over the decode
    steps, the mean decode step, the number of decode steps (tp=1: no wait, sync or comm)."""
    from shardwise.runtime.trace import _phases

    decode = {i for i, s in enumerate(export["steps"]) if s[0] != "prefill"}
    acc: dict[tuple[int, str], float] = {}
    for row in export["rows"]:
        if row[0] in decode:
            acc[(row[1], row[2])] = acc.get((row[1], row[2]), 0.0) + _phases(row)[0]
    n = max(len(decode), 1)
    step = sum(export["steps"][i][4] - export["steps"][i][3] for i in decode) / n / 1e9
    return {k: v / n / 1e9 for k, v in acc.items()}, step, len(decode)


def shardwise_traced(folder: Path, prompt: list[int], tokens: int, threads: int, dtype: str,
                     name: str, out: Path | None) -> dict[str, Any]:
    from shardwise.runtime.generate import generate
    from shardwise.runtime.trace import Tracer, chrome_trace, summarize

    torch.set_num_threads(threads)
    model = _shardwise_model(folder, dtype, len(prompt) + tokens)
    generate(model, prompt, 4, eos=set())  # warm-up, untraced
    tracer = Tracer(model).attach()
    result = generate(model, prompt, tokens, eos=set(), tracer=tracer)
    tracer.detach()
    export = tracer.export()
    blocks, step, steps = _block_times(export)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        meta = {"model": name, "tp": 1, "ep": 1, "measured_tok_per_s": result.decode_tok_per_s}
        (out / f"{name}.trace.json").write_text(json.dumps(chrome_trace([export], meta)))
        summary = summarize([export], name, 1, 1, result.decode_tok_per_s)
        (out / f"{name}.trace.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    del model, tracer
    gc.collect()
    return {"blocks": blocks, "step_s": step, "steps": steps, "tok_per_s": result.decode_tok_per_s}


@torch.no_grad()
def _prefill(model, prompt: list[int]) -> int:
    return int(model.lm_head.greedy(model(torch.tensor([prompt]), 0)[:, -1])[0])


@torch.no_grad()
def _decode_steps(model, token: int, start: int, n: int) -> None:
    """``n`` greedy decode steps from position ``start`` exactly as ``generate`` runs them (no clocks)."""
    for pos in range(start, start + n):
        token = int(model.lm_head.greedy(model(torch.tensor([[token]]), pos)[:, -1])[0])


def shardwise_profile(folder: Path, prompt: list[int], tokens: int, threads: int, dtype: str,
                      kinds: list[str]) -> tuple[dict[str, float], str]:
    """Inside the linear-attention mixers: ms per decode step of the compiled step (or, where it did
    not build, of the recurrence and the short conv) and the state snapshots (module functions wrapped with a clock, arguments and results untouched),
    then torch.profiler's top ops over ``tokens`` decode steps (prefill outside the profile)."""
    from torch.profiler import ProfilerActivity, profile

    from shardwise.runtime import deltanet, kda, linear_state

    torch.set_num_threads(threads)
    model = _shardwise_model(folder, dtype, len(prompt) + tokens + 1)
    _decode_steps(model, _prefill(model, prompt), len(prompt), 4)  # warm-up
    parts: dict[str, int] = {}
    patches = []

    def wrap(owner, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            out = original(*args, **kwargs)
            parts[label] = parts.get(label, 0) + time.perf_counter_ns() - t0
            return out

        setattr(owner, attr, timed)
        patches.append((owner, attr, original))

    op = linear_state.fused_step(torch.device("cpu"))
    if op is not None:  # gates, conv and recurrence are one compiled call (the torch functions below then idle)
        holder = SimpleNamespace(op=op)
        wrap(holder, "op", "compiled step (gates, conv + recurrence)")
        for owner in (deltanet, kda):
            patches.append((owner, "fused_step", getattr(owner, "fused_step")))
            owner.fused_step = lambda device: holder.op
    wrap(deltanet, "recurrent_step", "recurrence (one delta-rule step)")
    wrap(kda, "kda_step", "recurrence (one delta-rule step)")
    wrap(deltanet, "causal_conv", "short causal conv")
    wrap(kda, "causal_conv", "short causal conv")
    wrap(linear_state.LinearStateCache, "read", "state snapshot read + write")
    wrap(linear_state.LinearStateCache, "write", "state snapshot read + write")
    wrap(deltanet.GatedDeltaNet, "forward", "whole mixer (projections, norm, out_proj)")
    wrap(kda.KimiDeltaAttention, "forward", "whole mixer (projections, norm, out_proj)")
    try:
        token = _prefill(model, prompt)
        parts.clear()  # decode steps only
        _decode_steps(model, token, len(prompt), tokens)
    finally:
        for owner, attr, original in reversed(patches):
            setattr(owner, attr, original)
    layers = sum(k in ("gated_deltanet", "kda") for k in kinds)
    per_layer = {k: v / tokens / layers / 1e6 for k, v in parts.items()}
    token = _prefill(model, prompt)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _decode_steps(model, token, len(prompt), tokens)
    del model
    gc.collect()
    return per_layer, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


# ----------------------------------------------------------------------------- transformers


# ----------------------------------------------------------------------------- report


def per_kind(blocks: dict[tuple[int, str], float], kinds: list[str], mlps: list[str]) -> dict[str, dict[str, float]]:
    """Per mixer kind: layers, mean mixer-block and MLP-block seconds per layer, summed seconds per step.
    Layers with a dense MLP (Kimi Linear's first) are their own row: their MLP is not the MoE's."""
    out: dict[str, dict[str, float]] = {}
    for index, (kind, mlp) in enumerate(zip(kinds, mlps)):
        label = f"{kind} + dense MLP" if mlp == "dense" and set(mlps) != {"dense"} else kind
        row = out.setdefault(label, {"layers": 0, "mixer_s": 0.0, "mlp_s": 0.0, "total_s": 0.0})
        row["layers"] += 1
        row["mixer_s"] += blocks.get((index, "attn"), 0.0)
        row["mlp_s"] += blocks.get((index, "mlp"), 0.0)
    for row in out.values():
        row["total_s"] = row["mixer_s"] + row["mlp_s"]
        row["mixer_s"] /= row["layers"]
        row["mlp_s"] /= row["layers"]
    return out


def bench_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
    load = os.getloadavg()
    t0 = time.perf_counter()
    folder = checkpoint(model, args.hidden, args.layers)
    made_s = time.perf_counter() - t0
    size = sizes(folder, getattr(torch, args.dtype))
    prompt = [(7 * i + 3) % size["vocab"] for i in range(args.prompt)]
    ours, theirs = [], []
    for _ in range(args.rounds):
        rate, our_tokens = shardwise_tp1(folder, prompt, args.tokens, args.threads, args.dtype)
        ours.append(rate)
        rate, hf_tokens, impl = transformers_rate(folder, prompt, args.tokens, args.threads, args.dtype)
        theirs.append(rate)
        gc.collect()
    name = f"bench-hybrid-{model}-{args.hidden}x{args.layers}"
    traced = shardwise_traced(folder, prompt, args.tokens, args.threads, args.dtype, name, args.trace_out)
    hooked = transformers_blocks(folder, prompt, args.tokens, args.threads, args.dtype)
    same = next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens)) if a != b), None)
    best, hf = max(ours), max(theirs)
    point = f"tg{args.tokens} @ d{args.prompt}"

    kinds = " + ".join(f"{n} {k}" for k, n in size["layer_kinds"].items())
    print(f"\n== {model}: small scale widened to hidden {args.hidden}, {args.layers} layers ({kinds}), "
          f"{EXPERTS} experts top-{TOP_K}, vocab {size['vocab']}; {args.dtype}, {args.threads} thread(s)")
    print(f"checkpoint {size['file_bytes'] / 1e9:.3f} GB on disk ({size['params'] / 1e6:.0f} M params"
          f"{', written in %.0f s' % made_s if made_s > 1 else ''}), {size['token_bytes'] / 1e9:.3f} GB of weights "
          f"read per decode token ({size['active_params'] / 1e6:.0f} M active); {folder}")
    print(f"transformers: {impl}; load average before / after: {load[0]:.2f} / {os.getloadavg()[0]:.2f}")
    print(f"{'point':<14} {'shardwise tok/s':>16} {'transformers tok/s':>19} {'shardwise / transformers':>25}")
    print(f"{point:<14} {best:16.2f} {hf:19.2f} {best / hf:24.2f}x")
    print(f"  rounds: shardwise {', '.join(f'{x:.2f}' for x in ours)}; "
          f"transformers {', '.join(f'{x:.2f}' for x in theirs)}")
    print("  greedy tokens: " + ("identical" if same is None else f"first differ at new token {same}")
          + f" over {args.tokens}")
    ks = per_kind(traced["blocks"], size["kinds"], size["mlps"])
    kh = per_kind(hooked["blocks"], size["kinds"], size["mlps"])
    print(f"decode step, mean of {traced['steps']} (shardwise, traced: {traced['tok_per_s']:.2f} tok/s) / "
          f"{hooked['steps']} (transformers, hooked) steps: {traced['step_s'] * 1e3:.2f} ms / "
          f"{hooked['step_s'] * 1e3:.2f} ms")
    print(f"{'layer kind':<22} {'layers':>6} {'mixer ms/layer':>20} {'MLP ms/layer':>20} {'kind ms/step':>20}")
    print(f"{'':<22} {'':>6} {'shardwise    hf':>20} {'shardwise    hf':>20} {'shardwise    hf':>20}")
    for kind, row in ks.items():
        h = kh.get(kind, {"mixer_s": 0.0, "mlp_s": 0.0, "total_s": 0.0})
        cells = "".join(f" {row[c] * 1e3:11.3f} {h[c] * 1e3:7.3f}" for c in ("mixer_s", "mlp_s", "total_s"))
        print(f"{kind:<22} {row['layers']:6d}{cells}")
    rest_s = traced["step_s"] - sum(r["total_s"] for r in ks.values())
    rest_h = hooked["step_s"] - sum(r["total_s"] for r in kh.values())
    print(f"{'rest of step':<22} {'':>6} {'':>20} {'':>20} {rest_s * 1e3:11.3f} {rest_h * 1e3:7.3f}"
          f"   (embedding, final norm, LM head, pick; hf: + generate's own work)")
    doc = {"model": model, "point": point, "checkpoint": str(folder), "dtype": args.dtype, "threads": args.threads,
           **{k: size[k] for k in ("file_bytes", "params", "active_params", "token_bytes", "layer_kinds")},
           "shardwise_tok_per_s": best, "transformers_tok_per_s": hf, "ratio": best / hf,
           "rounds": {"shardwise": ours, "transformers": theirs}, "tokens_identical": same is None,
           "first_difference": same, "transformers_impl": impl,
           "step_s": {"shardwise": traced["step_s"], "transformers": hooked["step_s"]},
           "per_kind": {"shardwise": ks, "transformers": kh},
           "per_layer_ms": [{"layer": i, "kind": k, "mlp": m,
                             **{f"{side}_{block}": round(src.get((i, block), 0.0) * 1e3, 4)
                                for side, src in (("shardwise", traced["blocks"]), ("hf", hooked["blocks"]))
                                for block in ("attn", "mlp")}}
                            for i, (k, m) in enumerate(zip(size["kinds"], size["mlps"]))]}
    if args.profile:
        parts, table = shardwise_profile(folder, prompt, args.profile, args.threads, args.dtype, size["kinds"])
        print(f"inside a shardwise linear-attention layer, ms per decode step (mean of {args.profile} steps):")
        for label, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {label:<44} {ms:7.3f}")
        print(f"shardwise profile over {args.profile} decode steps, prefill excluded (top ops by self CPU time):")
        print(table)
        doc["linear_layer_parts_ms"] = parts
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("both", *MODELS), default="both")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (multiple of 256)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (every fourth full attention)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (the d of tgN @ dP)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens (the N of tgN)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both sides")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of shardwise and transformers")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="run dtype, both sides")
    parser.add_argument("--trace-out", type=Path, default=None, help="folder for the Chrome trace + summary")
    parser.add_argument("--profile", type=int, default=0, help="also profile N shardwise decode tokens")
    args = parser.parse_args()
    docs = [bench_model(m, args) for m in (MODELS if args.model == "both" else (args.model,))]
    print(json.dumps(docs))


if __name__ == "__main__":
    main()
