"""Kimi Linear (KDA linear attention + NoPE MLA + sigmoid-routed MoE) on the sharded runtime.

The reference is transformers' own ``KimiLinearForCausalLM`` (its pure-PyTorch KDA and conv
fallbacks), float32, every weight randomised, saved with ``save_pretrained`` (which writes the
checkpoint names Moonshot uses: ``block_sparse_moe.``, ``q_conv1d``, A_log [1, 1, H, 1]). Checked:

- the chunked (prefill) and recurrent (decode) KDA forms agree, kernel and whole model;
- logits within 1e-4 and identical greedy tokens at tp 1 (in process), 2 and 4 (gloo processes,
  every case of a world size in one launch), MoE over all ranks and with ep < tp;
- speculative greedy decoding (prompt lookup and a draft model, k = 1..6, tp 1 and 2) gives the
  plain greedy tokens, with the rejected positions' states poisoned at tp 1, and a verify pass
  gives bit-identical logits to single steps;
- MXFP4 experts (compressed-tensors) written by ``quantize``: the runtime matches the dequantized
  reference at tp 1 and 2, and the compressed-tensors library selects exactly the modules we
  packed (its target / ignore matching) and decodes them to our weights bit for bit. (Not through
  transformers' loader: transformers 5.24 cannot load any packed compressed-tensors kimi_linear
  checkpoint — its dequantize step, folded into the q/k/v conv concatenation, drops the float
  conv weights: "Concatenate on tensors destined for ...conv1d.weight. Ckpt contains: 0".)
- ``make-checkpoint`` output loads into transformers with every tensor found;
- settings the runtime does not implement are refused in one line (run);
- the planner's cache bytes per rank equal the runtime's KDA state + conv state + MLA cache.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from conftest import run_cli
from runtime_checks import PoisonRejected, compiled_step_matches_torch_ops, randomise
from shardwise.errors import ShardwiseError
from shardwise.perf.memory import rank_cache_bytes
from shardwise.plan import ParallelPlan, rank_param_counts
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.drafters import DraftModel, PromptLookup
from shardwise.runtime.exact import row_blocked
from shardwise.runtime.generate import generate
from shardwise.runtime.kda import kda_chunked, kda_step, l2_normalize
from shardwise.runtime.launch import launch_local
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM, check_runnable
from shardwise.runtime.quantize_checkpoint import dequantize_checkpoint, quantize_checkpoint
from shardwise.runtime.speculative import speculative_generate
from shardwise.spec.parse import load_model


def _transformers():
    """transformers, imported only where needed (the gloo ranks never import it: faster launches)."""
    return pytest.importorskip("transformers")

PROMPT = [3, 17, 101, 42, 7, 250, 11, 64, 5, 9, 33, 100]
REPEAT = [5, 9, 33, 100, 7, 8, 200, 3] * 3  # prompt lookup finds matches: drafts partly accepted
NEW = 16
KS = tuple(range(1, 7))
MAX_STEP = max(KS) + 1


def _config(layers: int = 4, seed_layers=(1, 3, 4), mla=(2,)):
    return _transformers().KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        num_expert_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "kda_layers": list(seed_layers), "full_attn_layers": list(mla)},
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def _decay_rates(name: str, t: torch.Tensor) -> bool:
    """KDA's decay parameters as FLA initialises them (randomise's rule for the rest)."""
    if name.endswith("A_log"):
        t.copy_(torch.empty_like(t).uniform_(1, 16).log())
    elif name.endswith("dt_bias"):
        t.copy_(torch.empty_like(t).uniform_(-6, -1))
    else:
        return False
    return True


def _save(config, folder, seed: int):
    """A transformers model with every weight random (decay rates as FLA initialises them), saved."""
    torch.manual_seed(seed)
    hf = _transformers().AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomise(hf, _decay_rates)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    hf = _save(_config(), root / "target", seed=11)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = hf(ids).logits[0]
        greedy = hf.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(PROMPT):].tolist()
    _save(_config(2, (1,), (2,)), root / "draft", seed=12)  # a smaller, unrelated draft model
    quantize_checkpoint(root / "target", root / "mxfp4", experts_only=True, compare=False)
    dequantize_checkpoint(root / "mxfp4", root / "mxfp4_ref")
    return {"logits": logits, "greedy": greedy, **{k: str(root / k) for k in ("target", "draft", "mxfp4", "mxfp4_ref")}}


def _model(folder: str, tp: int = 1, ep: int = 1, rank: int = 0, max_step_tokens: int = 1) -> ShardedCausalLM:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(tp=tp, ep=ep), rank, torch.float32,
                            max_seq_len=len(REPEAT) + NEW + MAX_STEP, max_step_tokens=max_step_tokens)
    load_shard(model, folder)
    return model


def _run_case(rank: int, folder: str, tp: int, ep: int) -> dict:
    model = _model(folder, tp, ep, rank)
    spec, plan = model.spec, model.plan
    with torch.no_grad():
        logits = model.logits(torch.tensor([PROMPT]))[0]
    return dict(
        logits=logits.numpy(), tokens=generate(model, PROMPT, NEW, eos=set()).tokens,
        param_bytes=model.param_bytes(), planned_bytes=4 * sum(rank_param_counts(spec, plan, rank).values()),
        cache_bytes=model.cache_bytes(), planned_cache=rank_cache_bytes(spec, plan, model.max_seq_len, 4.0, rank),
    )


def _check(ref_logits, ref_tokens, r: dict, label: str, bytes_too: bool = True) -> None:
    diff = float(abs(r["logits"] - ref_logits.numpy()).max())
    assert diff <= 1e-4, f"{label}: max |Δlogit| = {diff:.3g}"
    assert r["tokens"] == ref_tokens, f"{label}: greedy tokens differ"
    if bytes_too:
        assert r["param_bytes"] == r["planned_bytes"], f"{label}: weight bytes differ from the plan"
        assert r["cache_bytes"] == r["planned_cache"], (
            f"{label}: cache bytes {r['cache_bytes']} != plan {r['planned_cache']}"
        )


# ------------------------------------------------------------------------------- the KDA math


def test_chunked_equals_recurrent():
    """Several chunks, a padded tail and a non-zero initial state: chunked == token by token."""
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 2, 37, 3, 8
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    q, k = l2_normalize(q) * d**-0.5, l2_normalize(k)
    g = -torch.rand(b, t, h, d, generator=gen) * 0.7
    beta = torch.rand(b, t, h, generator=gen)
    state = 0.3 * torch.randn(b, h, d, d, generator=gen)
    out, final = kda_chunked(q, k, v, g, beta, state, chunk=8)
    s, steps = state, []
    for i in range(t):
        o, s = kda_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
        steps.append(o)
    assert (out - torch.stack(steps, 1)).abs().max() < 1e-5
    assert (final - s).abs().max() < 1e-5


def test_compiled_step_equals_torch_ops(ckpts, monkeypatch):
    """Decode through the compiled KDA step equals the torch ops it replaces (float32 to rounding;
    bfloat16, whose roundings the op repeats, within a few bfloat16 steps of the logits)."""
    diffs = compiled_step_matches_torch_ops(ckpts["target"], PROMPT + PROMPT[::-1], monkeypatch)
    assert diffs["torch.float32"] <= 1e-5 and diffs["torch.bfloat16"] <= 0.05, diffs


@torch.no_grad()
def test_prefill_then_decode_equals_token_by_token(ckpts):
    model = _model(ckpts["target"])
    whole = model.logits(torch.tensor([PROMPT]))[0]
    single = torch.cat([model.logits(torch.tensor([[tok]]), i)[0] for i, tok in enumerate(PROMPT)])
    assert (whole - single).abs().max() < 1e-5


# ------------------------------------------------------------------------------- against transformers


def test_tp1_matches_transformers(ckpts):
    _check(ckpts["logits"], ckpts["greedy"], _run_case(0, ckpts["target"], 1, 1), "tp1")


def _rank_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    out = [_run_case(rank, folder, tp, ep) for folder, tp, ep in cases]
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_transformers(ckpts, tp):
    eps = [tp, 1] if tp == 2 else [tp, 2]  # experts over all ranks; each expert split over tp/ep ranks
    cases = [(ckpts["target"], tp, ep) for ep in eps]
    if tp == 2:
        cases.append((ckpts["mxfp4"], 2, 2))
    results = launch_local(_rank_cases, tp, args=(cases,), timeout_s=120, run_timeout_s=240)
    ref = _run_case(0, ckpts["mxfp4_ref"], 1, 1) if tp == 2 else None
    for i, (folder, _, ep) in enumerate(cases):
        for rank in range(tp):
            label = f"tp{tp} ep{ep} rank {rank}"
            if folder == ckpts["mxfp4"]:
                _check(torch.tensor(ref["logits"]), ref["tokens"], results[rank][i], "mxfp4 " + label, bytes_too=False)
            else:
                _check(ckpts["logits"], ckpts["greedy"], results[rank][i], label)


# ------------------------------------------------------------------------------- speculative decoding


@torch.no_grad()
def _verify_equals_steps(model) -> bool:
    """7 positions verified in one pass give bit-identical logits to 7 single steps."""
    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17]])
    with row_blocked():
        model(torch.tensor([REPEAT[:8]]), 0)
        batched = model.logits(ids, 8)[0]
        model(torch.tensor([REPEAT[:8]]), 0)
        single = torch.stack([model.logits(ids[:, i : i + 1], 8 + i)[0, 0] for i in range(7)])
    return bool(torch.equal(single, batched))


def _spec_runs(tp: int) -> list[tuple[str, int]]:
    """(drafter, k): prompt lookup and the unrelated draft model at every k; the target as its own
    draft (every draft accepted) at the smallest and largest k (tp 1) or the largest (tp 2)."""
    own = (min(KS), max(KS)) if tp == 1 else (max(KS),)
    return [(m, k) for k in KS for m in ("ngram", "other", "self") if m != "self" or k in own]


def _spec_cases(rank: int, world_size: int, target: str, draft: str, poison: bool) -> dict:
    torch.set_num_threads(1)
    model = _model(target, world_size, 1, rank, max_step_tokens=MAX_STEP)
    out = {"bitwise": _verify_equals_steps(model), "plain": {}, "spec": {}, "accepted": {}}
    drafts = {"self": _model(target, max_step_tokens=MAX_STEP), "other": _model(draft, max_step_tokens=MAX_STEP)}
    for prompt in (PROMPT, REPEAT):
        out["plain"][len(prompt)] = generate(model, prompt, NEW, eos=set(), exact=True).tokens
    for method, k in _spec_runs(world_size):
        prompt = REPEAT if method == "ngram" else PROMPT
        drafter = PromptLookup() if method == "ngram" else DraftModel(drafts[method])
        if poison:
            drafter = PoisonRejected(drafter, model)
        result = speculative_generate(model, prompt, NEW, drafter, k, eos=set())
        out["spec"][method, k] = (len(prompt), result.tokens)
        out["accepted"][method, k] = (sum(result.accepted), sum(result.drafts))
    return out


def _check_spec(out: dict, label: str) -> None:
    assert out["bitwise"], f"{label}: verify-pass logits differ from single-step logits"
    for (method, k), (n, tokens) in out["spec"].items():
        assert tokens == out["plain"][n], f"{label} {method} k={k}: speculative tokens differ from plain greedy"
    for (method, k), (accepted, drafted) in out["accepted"].items():
        if method == "self":
            assert accepted == drafted > 0, f"{label} k={k}: the target as its own draft must have every draft accepted"
    rejected = sum(d - a for (m, _), (a, d) in out["accepted"].items() if m != "self")
    assert rejected > 0, f"{label}: no draft was ever rejected, so rollback was not exercised"


def test_speculative_greedy_exact_tp1(ckpts):
    _check_spec(_spec_cases(0, 1, ckpts["target"], ckpts["draft"], poison=True), "tp1")


def test_speculative_greedy_exact_tp2(ckpts):
    results = launch_local(_spec_cases, 2, args=(ckpts["target"], ckpts["draft"], False), timeout_s=120,
                           run_timeout_s=300)
    for rank in range(2):
        _check_spec(results[rank], f"tp2 rank {rank}")


def test_rolling_back_too_far_is_refused(ckpts):
    model = _model(ckpts["target"])  # plain decoding: one state per layer, no rollback
    with torch.no_grad():
        model(torch.tensor([PROMPT]), 0)
        model(torch.tensor([[1]]), len(PROMPT))
        with pytest.raises(ShardwiseError, match="max_step_tokens"):
            model(torch.tensor([[1]]), len(PROMPT))
    with pytest.raises(ShardwiseError, match="linear-attention"):
        model.check_step_tokens(2)


# ------------------------------------------------------------------------------- MXFP4


def _library_decoded(folder: str) -> tuple[set[str], set[str], dict[str, torch.Tensor]]:
    """(modules the compressed-tensors library quantizes under the config's targets / ignore rules,
    modules stored packed, the library's decoding of each packed weight)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_named_modules
    from safetensors import safe_open

    qc = QuantizationConfig.model_validate(json.loads(open(f"{folder}/config.json").read())["quantization_config"])
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    root = torch.nn.Module()  # every stored 2-D weight as a Linear at its module path
    linears = {k.removesuffix(".weight"): v.shape for k, v in stored.items() if k.endswith(".weight") and v.dim() == 2}
    packed = {k.removesuffix(".weight_packed") for k in stored if k.endswith(".weight_packed")}
    for m in packed:  # [out, in/2] packed bytes: the Linear is [out, in]
        out_rows, half = stored[m + ".weight_packed"].shape
        linears[m] = (out_rows, 2 * half)
    for path, (out, inp) in linears.items():
        if "embed_tokens" in path:
            continue
        parent = root
        for part in path.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(path.split(".")[-1], torch.nn.Linear(inp, out, bias=False, device="meta"))
    scheme = qc.config_groups["group_0"]
    chosen = {name for name, _ in match_named_modules(root, scheme.targets, qc.ignore)}
    compressor, decoded = BaseCompressor.get_value_from_registry(qc.format), {}
    for m in packed:
        module = torch.nn.Module()
        for part in ("weight_packed", "weight_scale"):
            module.register_parameter(part, torch.nn.Parameter(stored[f"{m}.{part}"], requires_grad=False))
        module.weight_shape = torch.nn.Parameter(torch.tensor(linears[m]), requires_grad=False)
        module.quantization_scheme = scheme
        compressor.decompress_module(module)
        decoded[m + ".weight"] = module.weight.detach()
    return chosen, packed, decoded


def test_mxfp4_round_trip(ckpts):
    """Experts packed in compressed-tensors MXFP4: our run equals the dequantized reference, and the
    compressed-tensors library picks exactly our packed modules and decodes them to our weights."""
    pytest.importorskip("compressed_tensors")
    config = json.loads(open(f"{ckpts['mxfp4']}/config.json").read())["quantization_config"]
    assert config["format"] == "mxfp4-pack-quantized" and r"re:.*block_sparse_moe\.gate$" in config["ignore"]
    with torch.no_grad():
        ours = _model(ckpts["mxfp4"]).logits(torch.tensor([PROMPT]))[0]
        ref = _model(ckpts["mxfp4_ref"]).logits(torch.tensor([PROMPT]))[0]
    assert (ours - ref).abs().max() <= 1e-4
    assert (ref - ckpts["logits"]).abs().max() > 1e-4  # the experts really were quantized
    chosen, packed, decoded = _library_decoded(ckpts["mxfp4"])
    assert chosen == packed and len(packed) == 3 * 8 * 3  # the routed experts of the 3 MoE layers, nothing else
    from safetensors import safe_open

    with safe_open(f"{ckpts['mxfp4_ref']}/model.safetensors", "pt") as f:
        for name, weight in decoded.items():  # MXFP4 values are exact in bf16: no tolerance
            assert torch.equal(weight.float(), f.get_tensor(name)), name


# ------------------------------------------------------------------------------- catalog, K3, bytes


def test_make_checkpoint_loads_in_transformers(tmp_path):
    folder = make_checkpoint("kimi-linear-48b-a3b", "tiny", tmp_path / "tiny", seed=3)
    hf, info = _transformers().AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([PROMPT])).logits[0]
        ours = _model(str(folder)).logits(torch.tensor([PROMPT]))[0]
    assert (ours - ref).abs().max() <= 1e-4


def test_settings_the_runtime_lacks_are_refused_in_one_line(tmp_path):
    """Kimi K3's extensions run (tests/test_runtime_kimi_k3.py); a kimi_linear setting no public
    definition covers here is refused in one line, by ``run`` before it reads any weight."""
    check_runnable(load_model("kimi-k3"), ParallelPlan(tp=16, ep=16))
    folder = tmp_path / "k3cfg"
    folder.mkdir()
    k3 = json.loads(resources.files("shardwise.spec.catalog.models").joinpath("kimi-k3.json").read_text())
    k3["text_config"].update(hidden_act="gelu", mla_use_nope=False)
    (folder / "config.json").write_text(json.dumps(k3))
    with pytest.raises(ShardwiseError, match="hidden_act 'gelu', mla_use_nope false"):
        check_runnable(load_spec(folder), ParallelPlan(tp=16, ep=16))
    proc = run_cli("run", str(folder), "--tp", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "hidden_act 'gelu'" in lines[0], proc.stderr


def test_planner_state_bytes_equal_runtime(ckpts):
    """KDA: fp32 state heads/tp × d_k × d_v + conv window 3·heads/tp·d × (kernel − 1) in the run
    dtype; MLA: the latent cache — per rank, as the planner counts them, for plain decoding and for
    verify passes of k + 1 = 5 positions (k + 2 state snapshots, k + kernel conv inputs)."""
    spec = load_spec(ckpts["target"])
    la = spec.linear_attention
    kda_layers = sum(layer.attention == "kda" for layer in spec.layers)
    for dtype, kv_bytes in ((torch.float32, 4.0), (torch.bfloat16, 2.0)):
        for step in (1, 5):
            for tp in (1, 2, 4):
                plan = ParallelPlan(tp=tp, ep=tp)
                for rank in range(tp):
                    model = ShardedCausalLM(spec, plan, rank, dtype, max_seq_len=40, max_step_tokens=step)
                    planned = rank_cache_bytes(spec, plan, 40, kv_bytes, rank, step_tokens=step)
                    assert model.cache_bytes() == planned, (dtype, step, tp, rank)
    # the runtime's own formula, float32, tp 1: one state + kernel - 1 conv inputs, plus k + 1 of each
    state, conv_position = la.state_elems * 4, la.conv_elems // (la.conv_kernel - 1) * 4
    plain = ShardedCausalLM(spec, ParallelPlan(), 0, torch.float32, max_seq_len=40).cache_bytes()
    spec5 = ShardedCausalLM(spec, ParallelPlan(), 0, torch.float32, max_seq_len=40, max_step_tokens=5).cache_bytes()
    assert spec5 - plain == kda_layers * 5 * (state + conv_position)
