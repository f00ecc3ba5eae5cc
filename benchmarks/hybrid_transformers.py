"""transformers' side of ``bench_hybrid.py``: the same checkpoint's greedy decode rate and, through timing hooks on
its decoder layers, where a decode step goes per layer and block (mixer vs MLP), cut where shardwise's trace cuts."""

from __future__ import annotations

import gc
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def _hf_model(folder: Path, dtype: str):
    import transformers

    transformers.logging.set_verbosity_error()  # the wrapper's vision weights are absent by design
    warnings.filterwarnings("ignore", message=".*rope_scaling.*", category=FutureWarning)  # Kimi's config key
    transformers.logging.disable_progress_bar()
    config = json.loads((folder / "config.json").read_text())
    wrapper = any("ConditionalGeneration" in a for a in config.get("architectures", []))
    auto = transformers.AutoModelForImageTextToText if wrapper else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # exactly N new tokens, no EOS masking (shardwise: eos=set())
    return model


def _hf_generate(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids, max_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0,
                         attention_mask=torch.ones_like(ids))
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == n, f"transformers made {len(new)} tokens, not {n}"
    return new


def transformers_rate(folder: Path, prompt: list[int], tokens: int, threads: int,
                      dtype: str) -> tuple[float, list[int], str]:
    """Decode tok/s = (N − 1) / (t(N) − t(1)) after a warm-up, the greedy tokens, the implementations used."""
    torch.set_num_threads(threads)
    model = _hf_model(folder, dtype)
    ids = torch.tensor([prompt])

    def timed(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.no_grad():
            new = _hf_generate(model, ids, n)
        return time.perf_counter() - t0, new

    timed(4)  # warm-up
    (one, _), (full, new) = timed(1), timed(tokens)
    cfg = getattr(model.config, "text_config", None) or model.config
    impl = f"attn {getattr(cfg, '_attn_implementation', '?')}, experts {getattr(cfg, '_experts_implementation', '?')}"
    return (tokens - 1) / (full - one), new, impl  # the model is freed with this frame


def transformers_blocks(folder: Path, prompt: list[int], tokens: int, threads: int, dtype: str) -> dict[str, Any]:
    """Mean seconds per (layer, block) over transformers' decode steps, cut like the trace: the
    mixer block from the decoder layer's start to its token mixer's output, the MLP block from
    there to the layer's end; ``step_s`` the mean time between decode steps' first-layer starts."""
    torch.set_num_threads(threads)
    model = _hf_model(folder, dtype)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    clock = time.perf_counter_ns
    acc: dict[tuple[int, str], int] = {}
    starts: list[int] = []
    state = {"decode": False, "mark": 0}
    handles = []

    def width(args, kwargs) -> int:
        x = args[0] if args else kwargs["hidden_states"]
        return x.shape[1]

    for index, layer in enumerate(layers):
        mixer = getattr(layer, "linear_attn", None) or layer.self_attn

        def start(module, args, kwargs, index=index):
            state["decode"] = width(args, kwargs) == 1
            state["mark"] = clock()
            if index == 0 and state["decode"]:
                starts.append(state["mark"])

        def mixed(module, args, out, index=index):
            if state["decode"]:
                now = clock()
                acc[(index, "attn")] = acc.get((index, "attn"), 0) + now - state["mark"]
                state["mark"] = now

        def ended(module, args, out, index=index):
            if state["decode"]:
                acc[(index, "mlp")] = acc.get((index, "mlp"), 0) + clock() - state["mark"]

        handles += [layer.register_forward_pre_hook(start, with_kwargs=True), mixer.register_forward_hook(mixed),
                    layer.register_forward_hook(ended)]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        _hf_generate(model, ids, 4)  # warm-up (its steps are cleared below)
        acc.clear()
        starts.clear()
        t0 = time.perf_counter()
        _hf_generate(model, ids, tokens)
        wall = time.perf_counter() - t0
    for h in handles:
        h.remove()
    del model
    gc.collect()
    n = max(len(starts), 1)
    step = (starts[-1] - starts[0]) / (len(starts) - 1) / 1e9 if len(starts) > 1 else 0.0
    return {"blocks": {k: v / n / 1e9 for k, v in acc.items()}, "step_s": step, "steps": len(starts), "wall_s": wall}
