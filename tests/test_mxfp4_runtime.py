"""MXFP4 checkpoints end to end: writing (gpt-oss and compressed-tensors layouts), loading
each rank's packed slices, running at tp = 1 and 2 (real gloo processes), resident bytes
against the planner, transformers' own MXFP4 loader, the compressed-tensors library's
decompression, and bad input.

The reference for a quantized checkpoint is the float32 model whose weights equal
decode(blocks, scales) exactly (``dequantize_checkpoint``); for gpt-oss it is also
transformers' ``GptOssForCausalLM`` loading the MXFP4 checkpoint with
``Mxfp4Config(dequantize=True)`` (its CPU path: ``convert_moe_packed_tensors``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import run_cli
from runtime_checks import library_and_reference
from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan, rank_param_counts, shard_shape
from shardwise.quant.formats import get_format
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.generate import SamplingParams, generate
from shardwise.runtime.launch import launch_local
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.mxfp4_matmul import decode
from shardwise.runtime.quantize_checkpoint import dequantize_checkpoint, quantize_checkpoint
from shardwise.spec.model import ROUTED_EXPERTS

PROMPT = [3, 17, 101, 42, 7, 250, 11, 64]
MXFP4_BYTES_PER_WEIGHT = get_format("mxfp4").bits_per_weight / 8


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _model(folder: Path, tp: int = 1, ep: int = 1, rank: int = 0) -> ShardedCausalLM:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(tp=tp, ep=ep), rank, torch.float32, max_seq_len=64)
    load_shard(model, folder)
    return model


def _logits(folder: Path, tp: int = 1, ep: int = 1, rank: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return _model(folder, tp, ep, rank).logits(torch.tensor([PROMPT]))


def _transformers_gpt_oss(folder: Path) -> Path:
    """A float32 gpt-oss built and saved by transformers (non-square gate_up: H 64, 2I 128)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = transformers.GptOssForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, t in model.named_parameters():
            t.copy_(1 + 0.1 * torch.randn_like(t) if "norm" in name else 0.05 * torch.randn_like(t))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mxfp4")
    out = {
        # shardwise's own writer, gpt-oss layout (make_checkpoint → quantize)
        "gpt_oss": make_checkpoint("gpt-oss-20b", "tiny", root / "gpt_oss", seed=5, quant="mxfp4",
                                   overrides={"intermediate_size": 64}),
        # compressed-tensors, experts only; experts wide enough to split into whole blocks at etp 2
        "qwen3_moe": make_checkpoint("qwen3-30b-a3b", "tiny", root / "qwen3_moe", seed=6, quant="mxfp4",
                                     overrides={"moe_intermediate_size": 64}),
    }
    # compressed-tensors, every eligible Linear (attention, dense and shared MLPs too)
    ds = make_checkpoint("deepseek-v3", "tiny", root / "deepseek_float", seed=7)
    quantize_checkpoint(ds, root / "deepseek_v3", compare=False)
    out["deepseek_v3"] = root / "deepseek_v3"
    # Qwen3.5 (a VL wrapper: quantization_config beside text_config), every eligible Linear: the fused
    # q|k|v of Gated DeltaNet too, which each rank reads as its own row spans of the packed tensor
    q35 = make_checkpoint("qwen3.5-397b-a17b", "tiny", root / "qwen3_5_float", seed=8)
    quantize_checkpoint(q35, root / "qwen3_5", compare=False)
    out["qwen3_5"] = root / "qwen3_5"
    # a transformers-saved float gpt-oss, quantized by `shardwise quantize` (up-rounded scales)
    hf_float = _transformers_gpt_oss(root / "hf_float")
    out["hf_float"] = hf_float
    quantize_checkpoint(hf_float, root / "hf_gpt_oss", scale_rounding="up", compare=False)
    out["hf_gpt_oss"] = root / "hf_gpt_oss"
    for key in ("gpt_oss", "qwen3_moe", "deepseek_v3", "hf_gpt_oss", "qwen3_5"):
        out[key + "_ref"] = dequantize_checkpoint(out[key], root / f"{key}_ref")
    return out


def test_written_layouts_and_configs(ckpts):
    cfg = json.loads((ckpts["gpt_oss"] / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    t = _tensors(ckpts["gpt_oss"])
    assert t["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (8, 128, 2, 16)
    assert t["model.layers.0.mlp.experts.gate_up_proj_scales"].shape == (8, 128, 2)
    assert t["model.layers.0.mlp.experts.down_proj_blocks"].shape == (8, 64, 2, 16)
    assert t["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert "model.layers.0.mlp.experts.gate_up_proj" not in t
    assert t["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype == torch.float32
    ct = json.loads((ckpts["qwen3_moe"] / "config.json").read_text())["quantization_config"]
    assert ct["quant_method"] == "compressed-tensors" and ct["format"] == "mxfp4-pack-quantized"
    assert ct["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert r"re:^model\.layers\.\d+\.self_attn\.q_proj$" in ct["ignore"] and "lm_head" in ct["ignore"]
    t = _tensors(ckpts["qwen3_moe"])
    assert t["model.layers.1.mlp.experts.3.down_proj.weight_packed"].shape == (64, 32)
    assert t["model.layers.1.mlp.experts.3.down_proj.weight_scale"].shape == (64, 2)
    assert t["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    for key in ("gpt_oss", "qwen3_moe"):  # the planner reads the format from the config
        assert load_spec(ckpts[key]).quant_formats[ROUTED_EXPERTS] == "mxfp4"
    ds = _tensors(ckpts["deepseek_v3"])  # full quantization; kv_b_proj (16 inputs) stays float
    assert "model.layers.0.self_attn.q_a_proj.weight_packed" in ds and "model.layers.0.mlp.down_proj.weight_packed" in ds
    assert "model.layers.0.self_attn.kv_b_proj.weight" in ds


def test_tp1_matches_dequantized_reference(ckpts):
    for key in ("gpt_oss", "qwen3_moe", "deepseek_v3", "hf_gpt_oss"):
        diff = (_logits(ckpts[key]) - _logits(ckpts[key + "_ref"])).abs().max().item()
        assert diff <= 1e-4, f"{key}: max |Δlogit| = {diff:.3g}"


def test_transformers_reads_our_gpt_oss_checkpoint(ckpts):
    """transformers' own MXFP4 dequantization of our files gives our weights and our logits."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for key in ("gpt_oss", "hf_gpt_oss"):
        t = _tensors(ckpts[key])
        for proj in ("gate_up_proj", "down_proj"):
            blocks, scales = t[f"model.layers.1.mlp.experts.{proj}_blocks"], t[f"model.layers.1.mlp.experts.{proj}_scales"]
            theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
            assert torch.equal(theirs, decode(blocks, scales, torch.float32).transpose(1, 2)), (key, proj)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            ckpts[key], dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
        ).eval()
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPT])).logits
        diff = (_logits(ckpts[key]) - ref).abs().max().item()
        assert diff <= 1e-4, f"{key}: max |Δlogit| vs transformers = {diff:.3g}"
    # the float original, in transformers, differs only by the quantization error
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts["hf_float"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits
    assert (_logits(ckpts["hf_float"]) - ref).abs().max().item() <= 1e-4


def test_compressed_tensors_reads_our_checkpoints(ckpts):
    """The compressed-tensors library (through transformers' loader) decompresses exactly the
    modules we packed, to our decoded weights bit for bit, and its model gives our logits."""
    for key in ("qwen3_moe", "deepseek_v3"):
        hf, theirs, reference = library_and_reference(ckpts[key], ckpts[key + "_ref"])
        for name, t in theirs.items():  # MXFP4 values are exact in bf16: no tolerance
            assert torch.equal(t.float(), reference[name]), (key, name)
        with torch.no_grad():
            logits = hf.float()(torch.tensor([PROMPT])).logits
        diff = (_logits(ckpts[key]) - logits).abs().max().item()
        assert diff <= 1e-4, f"{key}: max |Δlogit| vs compressed-tensors = {diff:.3g}"


def _rank_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    out = []
    for folder, tp, ep in cases:
        model = _model(Path(folder), tp, ep, rank)
        with torch.no_grad():
            logits = model.logits(torch.tensor([PROMPT]))
        out.append({"logits": logits.numpy(), "tokens": generate(model, PROMPT, 8, SamplingParams()).tokens})
    return out


def test_tp2_matches_dequantized_reference(ckpts):
    cases = [("gpt_oss", 2, 2), ("gpt_oss", 2, 1), ("qwen3_moe", 2, 2), ("qwen3_moe", 2, 1), ("deepseek_v3", 2, 2),
             ("hf_gpt_oss", 2, 2), ("qwen3_5", 2, 2)]
    results = launch_local(_rank_cases, 2, args=([(str(ckpts[k]), tp, ep) for k, tp, ep in cases],),
                           timeout_s=120, run_timeout_s=240)
    for i, (key, tp, ep) in enumerate(cases):
        ref_model = _model(ckpts[key + "_ref"])
        with torch.no_grad():
            ref = ref_model.logits(torch.tensor([PROMPT])).numpy()
        tokens = generate(ref_model, PROMPT, 8, SamplingParams()).tokens
        for rank in range(tp):
            r = results[rank][i]
            diff = float(abs(r["logits"] - ref).max())
            assert diff <= 1e-4, f"{key} tp{tp} ep{ep} rank {rank}: max |Δlogit| = {diff:.3g}"
            assert r["tokens"] == tokens, f"{key} tp{tp} ep{ep} rank {rank}: greedy tokens differ"


def test_resident_expert_bytes_equal_the_plan(ckpts):
    """Packed blocks + scales of a rank's experts = its planned expert params × 4.25 / 8, exactly."""
    for key, tp, ep in (("gpt_oss", 2, 2), ("gpt_oss", 2, 1), ("qwen3_moe", 2, 2), ("qwen3_moe", 2, 1)):
        spec = load_spec(ckpts[key])
        plan = ParallelPlan(tp=tp, ep=ep)
        for rank in range(tp):
            model = _model(ckpts[key], tp, ep, rank)
            packed = sum(p.numel() for p in model.parameters() if getattr(p, "packed", None))
            weights = 0  # the planner's routed-expert params without gpt-oss's float biases
            for layer in spec.layers:
                for t in layer.tensors:
                    if t.is_routed and not t.name.endswith("_bias"):
                        n = torch.Size(shard_shape(t, plan, rank)).numel()
                        weights += n if t.expert_dim is not None else n * t.experts // ep
            assert packed == weights * MXFP4_BYTES_PER_WEIGHT, (key, tp, ep, rank)
            planned = rank_param_counts(spec, plan, rank)[ROUTED_EXPERTS]
            assert planned - weights == (0 if key == "qwen3_moe" else sum(
                p.numel() for n, p in model.named_parameters() if n.endswith("_bias") and ".experts." in n))
            assert all(p.dtype == torch.uint8 for p in model.parameters() if getattr(p, "packed", None))


def test_quantize_and_run_cli(ckpts, tmp_path):
    out = tmp_path / "q"
    proc = run_cli("quantize", str(ckpts["hf_float"]), "--format", "mxfp4", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["layout"] == "gpt-oss-mxfp4" and doc["bytes_after"] < doc["bytes_before"] / 2
    assert doc["groups"]["routed_experts"]["rel_rms"] < 0.2 and doc["logits_max_abs"] > 0
    assert abs(doc["groups"]["routed_experts"]["bits_after"] - 4.25) < 1.0  # biases stay float32
    proc = run_cli("run", str(out), "--tp", "2", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    ref = dequantize_checkpoint(out, tmp_path / "ref")
    assert json.loads(proc.stdout)["tokens"] == generate(_model(ref), PROMPT, 8, SamplingParams()).tokens
    proc = run_cli("quantize", str(ckpts["hf_float"]), "--format", "nvfp4", "--out", str(tmp_path / "n"))
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --format nvfp4 cannot be written yet: quantize writes mxfp4, int8, int4"


def _corrupt(src: Path, folder: Path, tensors: dict | None = None, config: dict | None = None) -> Path:
    folder.mkdir()
    save_file(tensors if tensors is not None else _tensors(src), str(folder / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return folder


@pytest.mark.parametrize("case", ["block_shape", "scale_dtype", "unknown_method", "fp8"])
def test_bad_input_fails_before_generation(ckpts, tmp_path, case):
    if case == "block_shape":
        t = _tensors(ckpts["gpt_oss"])
        name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
        t[name] = t[name][..., :15].contiguous()
        folder = _corrupt(ckpts["gpt_oss"], tmp_path / case, t)
        expected = (f"MXFP4 checkpoint tensor '{name}' has shape [8, 128, 2, 15], "
                    "expected uint8 [E, out, in/32, 16] = [8, 128, 2, 16]")
    elif case == "scale_dtype":
        t = _tensors(ckpts["qwen3_moe"])
        name = "model.layers.1.mlp.experts.3.up_proj.weight_scale"
        t[name] = t[name].float()
        folder = _corrupt(ckpts["qwen3_moe"], tmp_path / case, t)
        expected = f"MXFP4 checkpoint tensor '{name}' has dtype float32, expected uint8 [out, in/32] = [64, 2]"
    elif case == "unknown_method":
        folder = _corrupt(ckpts["qwen3_moe"], tmp_path / case, config={"quantization_config": {"quant_method": "awq"}})
        expected = ("quantization_config quant_method 'awq' is not supported: "
                    "shardwise reads mxfp4, fp8, compressed-tensors, modelopt")
    else:
        folder = _corrupt(ckpts["qwen3_moe"], tmp_path / case, config={"quantization_config": {"quant_method": "fp8"}})
        expected = ("quantization_config.quant_method 'fp8' has no MXFP4 layout here, expected 'mxfp4' (gpt-oss) or "
                    "'compressed-tensors' with format 'mxfp4-pack-quantized': use a BF16 or MXFP4 checkpoint")
    with pytest.raises(ShardwiseError) as err:
        _model(folder)
    assert str(err.value).endswith(expected)  # config errors name the file first
    proc = run_cli("run", str(folder), "--tp", "2", "--prompt-ids", "1,2,3")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and proc.stderr.strip().endswith(expected)
    assert len(proc.stderr.strip().splitlines()) == 1


def test_split_inside_a_block_is_refused(ckpts, tmp_path):
    """tiny gpt-oss's default 32-wide experts cannot be cut in half by expert TP."""
    folder = make_checkpoint("gpt-oss-20b", "tiny", tmp_path / "narrow", seed=1, quant="mxfp4")
    with pytest.raises(ShardwiseError, match=r"'model.layers.0.mlp.experts.down_proj' would be split into 16-element"):
        _model(folder, tp=2, ep=1)
    assert torch.isfinite(_logits(folder)).all()
