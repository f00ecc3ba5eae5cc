"""Weight-only int8 (per channel) and int4 (per group) checkpoints end to end: what `quantize`
writes (compressed-tensors pack-quantized, read by the compressed-tensors library itself), the
runtime's packed weights and kernel at tp 1 and 2 (real gloo processes), bytes held against the
planner, speculative decoding on them, and bad input.

The reference for a quantized checkpoint is the float32 checkpoint whose weights equal
q × scale exactly (``dequantize_checkpoint``); the runtime must match it to 1e-4 in logits and
exactly in greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import run_cli
from runtime_checks import library_and_reference
from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan
from shardwise.perf.memory import rank_group_bytes
from shardwise.quant.formats import get_format
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.drafters import PromptLookup
from shardwise.runtime.generate import SamplingParams, generate
from shardwise.runtime.int_matmul import IntWeight
from shardwise.runtime.launch import launch_local
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.quantize_checkpoint import dequantize_checkpoint, quantize_checkpoint
from shardwise.runtime.speculative import speculative_generate

PROMPT = [3, 17, 101, 42, 7, 250, 11, 64, 3, 17, 101]


def _model(folder: Path, tp: int = 1, ep: int = 1, rank: int = 0, max_step_tokens: int = 1) -> ShardedCausalLM:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(tp=tp, ep=ep), rank, torch.float32, max_seq_len=64,
                            max_step_tokens=max_step_tokens)
    load_shard(model, folder)
    return model


def _logits(folder: Path, tp: int = 1, ep: int = 1, rank: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return _model(folder, tp, ep, rank).logits(torch.tensor([PROMPT]))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("intq")
    floats = {
        "llama": make_checkpoint("llama-3.1-8b", "tiny", root / "llama", seed=11),
        "qwen3_moe": make_checkpoint("qwen3-30b-a3b", "tiny", root / "qwen3_moe", seed=12),
        "qwen3_5": make_checkpoint("qwen3.5-397b-a17b", "tiny", root / "qwen3_5", seed=13),
    }
    out = {}
    for key, src in floats.items():
        for fmt in ("int8", "int4"):
            name = f"{key}_{fmt}"
            out[name] = root / name
            quantize_checkpoint(src, out[name], fmt, compare=False)
            out[name + "_ref"] = dequantize_checkpoint(out[name], root / (name + "_ref"))
    out["llama_float"] = floats["llama"]
    # the LM head quantized too (--lm-head), over a vocabulary two ranks split unevenly (a padding row)
    odd = make_checkpoint("llama-3.1-8b", "tiny", root / "llama_v509", seed=14, overrides={"vocab_size": 509})
    for fmt in ("int8", "int4"):
        name = f"llama_{fmt}_head"
        out[name] = root / name
        quantize_checkpoint(odd, out[name], fmt, compare=False, lm_head=True)
        out[name + "_ref"] = dequantize_checkpoint(out[name], root / (name + "_ref"))
    return out


def test_written_layout(ckpts):
    config = json.loads((ckpts["llama_int4"] / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["quant_method"] == "compressed-tensors"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"], weights["type"]) == (4, "group", 32, "int")
    with safe_open(ckpts["llama_int4"] / "model.safetensors", framework="pt") as f:
        name = "model.layers.0.mlp.down_proj"
        packed, scale = f.get_tensor(f"{name}.weight_packed"), f.get_tensor(f"{name}.weight_scale")
        assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16
        assert f.get_tensor(f"{name}.weight_shape").tolist() == [packed.shape[0], packed.shape[1] * 8]
        assert scale.shape == (packed.shape[0], packed.shape[1] * 8 // 32)
        assert "lm_head.weight" in f.keys() and "model.embed_tokens.weight" in f.keys()  # kept float
    weights8 = json.loads((ckpts["llama_int8"] / "config.json").read_text())["quantization_config"]["config_groups"]
    assert (weights8["group_0"]["weights"]["strategy"], weights8["group_0"]["weights"]["group_size"]) == ("channel", None)


def test_lm_head_quantized_on_request(ckpts, tmp_path):
    """``--lm-head`` packs the LM head in the layers' scheme (no ``lm_head`` ignore rule), the planner
    prices it so, and the runtime holds it packed on every rank (the last rank's padding row scaled
    to zero, never the argmax); formats that cannot, and a head tied to the embedding, are refused."""
    for fmt, planned in (("int8", "int8"), ("int4", "int4-g32")):
        folder = ckpts[f"llama_{fmt}_head"]
        config = json.loads((folder / "config.json").read_text())["quantization_config"]
        assert "lm_head" not in config["ignore"]
        assert load_spec(folder).quant_formats["lm_head"] == planned
        assert "lm_head" not in load_spec(ckpts[f"llama_{fmt}"]).quant_formats  # the default keeps it float
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            assert "lm_head.weight_packed" in f.keys() and "lm_head.weight" not in f.keys()
        for rank in (0, 1):
            head = _model(folder, 2, 1, rank).lm_head
            assert isinstance(head.weight, IntWeight) and head.weight.q.shape[0] == 255
            assert (head.stop - head.start, int(head.weight.scale[head.stop - head.start:].abs().sum())) == (
                (255, 0) if rank == 0 else (254, 0))
    src = ckpts["llama_float"]
    with pytest.raises(ShardwiseError, match="--lm-head applies to int8/int4"):
        quantize_checkpoint(src, tmp_path / "mx", "mxfp4", compare=False, lm_head=True)
    tied = make_checkpoint("llama-3.1-8b", "tiny", tmp_path / "tied", seed=3, overrides={"tie_word_embeddings": True})
    with pytest.raises(ShardwiseError, match="tie_word_embeddings"):
        quantize_checkpoint(tied, tmp_path / "t8", "int8", compare=False, lm_head=True)


def test_compressed_tensors_reads_our_checkpoints(ckpts):
    """The compressed-tensors library (through transformers' loader) decompresses our int8/int4
    checkpoints to our weights: it multiplies q by the scale in the scale's dtype (bfloat16), so
    its values are our exact q × scale rounded to bfloat16, bit for bit; unquantized tensors are
    identical. (Its logits therefore differ from the exact weights' by the bfloat16 rounding.)"""
    for key in ("llama_int8", "llama_int4", "qwen3_moe_int4", "llama_int4_head"):
        _, theirs, reference = library_and_reference(ckpts[key], ckpts[key + "_ref"])
        with safe_open(ckpts[key] / "model.safetensors", framework="pt") as f:
            packed = {k.removesuffix("_packed") for k in f.keys() if k.endswith(".weight_packed")}
        rounded = 0
        for name, t in theirs.items():
            quantized = name in packed or ".experts." in name  # transformers fuses the (packed) experts
            expected = reference[name].to(torch.bfloat16).float() if quantized else reference[name]
            assert torch.equal(t.float(), expected), (key, name)
            rounded += quantized
        assert rounded >= 12, f"{key}: only {rounded} tensors came back from the library's int decompression"


def _rank_cases(rank: int, world_size: int, cases: list) -> list[dict]:
    torch.set_num_threads(1)
    out = []
    for folder, tp, ep in cases:
        model = _model(Path(folder), tp, ep, rank)
        held = sum(isinstance(m, IntWeight) for m in model.modules())
        with torch.no_grad():
            logits = model.logits(torch.tensor([PROMPT]))
        out.append({"logits": logits.numpy(), "tokens": generate(model, PROMPT, 8, SamplingParams()).tokens,
                    "int_weights": held})
    return out


TP1 = ["llama_int8", "llama_int4", "qwen3_moe_int8", "qwen3_moe_int4", "qwen3_5_int4", "qwen3_5_int8",
       "llama_int8_head", "llama_int4_head"]
TP2 = [("llama_int8", 2, 1), ("llama_int4", 2, 1), ("qwen3_moe_int4", 2, 2), ("qwen3_moe_int8", 2, 1),
       ("qwen3_5_int8", 2, 1), ("llama_int8_head", 2, 1), ("llama_int4_head", 2, 1)]


def _reference(ckpts, key: str) -> tuple:
    ref_model = _model(ckpts[key + "_ref"])
    with torch.no_grad():
        logits = ref_model.logits(torch.tensor([PROMPT])).numpy()
    return logits, generate(ref_model, PROMPT, 8, SamplingParams()).tokens


def test_tp1_matches_the_dequantized_reference(ckpts):
    for key in TP1:
        [r] = _rank_cases(0, 1, [(str(ckpts[key]), 1, 1)])
        ref, tokens = _reference(ckpts, key)
        assert r["int_weights"] > 0, f"{key}: no Linear runs packed"
        diff = float(abs(r["logits"] - ref).max())
        assert diff <= 1e-4, f"{key} tp1: max |Δlogit| = {diff:.3g}"
        assert r["tokens"] == tokens, f"{key} tp1: greedy tokens differ"


def test_tp2_matches_the_dequantized_reference(ckpts):
    """Column-parallel rows and row-parallel input slices of the packed words and scales
    (per-channel scales whole on every rank, group scales split with their groups)."""
    results = launch_local(_rank_cases, 2, args=([(str(ckpts[k]), tp, ep) for k, tp, ep in TP2],),
                           timeout_s=180, run_timeout_s=300)
    for i, (key, tp, ep) in enumerate(TP2):
        ref, tokens = _reference(ckpts, key)
        for rank in range(2):
            r = results[rank][i]
            assert r["int_weights"] > 0, f"{key}: no Linear runs packed"
            diff = float(abs(r["logits"] - ref).max())
            assert diff <= 1e-4, f"{key} tp{tp} ep{ep} rank {rank}: max |Δlogit| = {diff:.3g}"
            assert r["tokens"] == tokens, f"{key} tp{tp} ep{ep} rank {rank}: greedy tokens differ"


def test_resident_bytes_equal_the_plan(ckpts):
    """A rank holds its int4 weights at exactly the planner's 4.5 bits per weight, and its int8
    weights at the planner's 8 bits plus one bfloat16 scale per output row it holds."""
    for key in ("llama_int4", "llama_int8", "qwen3_moe_int4", "llama_int8_head", "llama_int4_head"):
        spec = load_spec(ckpts[key])
        for tp in (1, 2):
            ep = tp if spec.moe else 1
            plan = ParallelPlan(tp=tp, ep=ep)
            bits = {g: get_format(f).bits_per_weight for g, f in spec.run_formats("fp32").items()}
            for rank in range(tp):
                model = _model(ckpts[key], tp, ep, rank)
                held = [m for m in model.modules() if isinstance(m, IntWeight)]
                packed = sum(m.q.numel() * m.q.element_size() + m.scale.numel() * 2 for m in held)
                row_scales = sum(m.scale.numel() for m in held) * 2 if "int8" in key else 0
                planned = rank_group_bytes(spec, plan, bits, rank)
                planned_int = sum(v for g, v in planned.items() if spec.run_formats("fp32")[g].startswith("int"))
                assert packed == planned_int + row_scales, (key, tp, rank)
                assert all(m.scale.dtype == torch.bfloat16 for m in held)


def test_kernel_rows_do_not_depend_on_the_batch(ckpts):
    """Each row of a many-row product equals that row alone, bit for bit (so speculative verify
    passes equal single steps), in float32 and bfloat16, and equals the dequantized product."""
    torch.manual_seed(0)
    for key in ("llama_int8", "llama_int4"):
        model = _model(ckpts[key])
        weight = model.model.layers[0].mlp.down_proj.weight
        assert isinstance(weight, IntWeight)
        exact_weight = weight.dequantized().double()
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(9, weight.in_features).to(dtype)
            many = weight(x)
            assert many.dtype == dtype
            for i in range(9):
                assert torch.equal(weight(x[i:i + 1]), many[i:i + 1]), (key, dtype, i)
            # bfloat16 rows are as exact as float32 ones: within one rounding of the output to the row dtype
            exact = (x.double() @ exact_weight.T).to(dtype)
            torch.testing.assert_close(many.float(), exact.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5,
                                       atol=1e-5)
        x = torch.randn(3, weight.in_features)
        exact = x.double() @ weight.dequantized().double().T
        assert torch.allclose(weight(x).double(), exact, rtol=1e-5, atol=1e-5)


def test_many_rows_run_as_gemms_over_dequantized_blocks(ckpts, monkeypatch):
    """A pass of GEMM_ROWS rows or more (a prefill) multiplies blocks of the dequantized weight (every value q
    times its scale, as ``dequantized`` holds it; bfloat16 blocks for bfloat16 rows): within float32 rounding
    of the exact product for float32 rows, in several blocks; under ``exact.row_blocked()`` it keeps the
    row-invariant kernel (each row's bits alone)."""
    from shardwise.runtime import int_matmul
    from shardwise.runtime.exact import row_blocked

    monkeypatch.setattr(int_matmul, "BLOCK_ELEMENTS", 64 * 64)  # several blocks and a short last one
    for key in ("llama_int8", "llama_int4"):
        weight = _model(ckpts[key]).model.layers[0].mlp.gate_proj.weight
        dq = int_matmul.cpp_ops.optional_op("int_dequantize.cpp", "shardwise_intdq", "int_dequantize")
        whole = dq(weight.q, weight.scale, weight.bits, weight.group, 0, weight.q.shape[0], torch.float32)
        assert torch.equal(whole, weight.dequantized())
        assert torch.equal(dq(weight.q, weight.scale, weight.bits, weight.group, 3, 5, torch.bfloat16), whole[3:8].bfloat16())
        x = torch.randn(int_matmul.GEMM_ROWS + 3, weight.in_features)
        exact = x.double() @ weight.dequantized().double().T
        many = weight(x)
        torch.testing.assert_close(many.double(), exact, rtol=1e-5, atol=1e-5)
        assert not torch.equal(many[:1], weight(x[:1]))  # not the kernel's bits: the GEMM ran
        with row_blocked():
            blocked = weight(x)
        assert all(torch.equal(blocked[i : i + 1], weight(x[i : i + 1])) for i in range(x.shape[0]))
        many_bf16 = weight(x.bfloat16())
        assert many_bf16.dtype == torch.bfloat16
        xb, w = x.bfloat16().double(), weight.dequantized().double()
        bound = 2 ** -8 * (xb.abs() @ w.abs().T)  # each weight and the output rounded once to bfloat16
        assert bool(((many_bf16.double() - xb @ w.T).abs() <= bound).all())


@pytest.mark.parametrize("group", [32, 64, 128, 384])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row_dtype", [torch.bfloat16, torch.float32])
def test_kernel_rows_times_4_bit_weights(group, scale_dtype, row_dtype):
    """bfloat16 rows (a bfloat16 model's activations) or float32 ones times 4-bit weights: the kernel's
    64-byte line paths (widths that are whole 128-weight chunks: vdpbf16ps for bfloat16 rows, a table permute
    per 16 weights for float32 ones) and its 32-weight one (other widths) all equal the exact product to
    float32 rounding, row by row whatever the batch; every group size the checkpoint scheme allows, scales as
    stored in either dtype."""
    from shardwise.runtime.int_matmul import kernel

    gen = torch.Generator().manual_seed(group)
    for width in (384, 3 * group) if group < 128 else (384,):  # 3 · 32 and 3 · 64: no whole chunks
        q = torch.randint(0, 256, (37, width // 2), dtype=torch.uint8, generator=gen)
        scale = (torch.rand(37, width // group, generator=gen) * 0.1 + 0.01).to(scale_dtype)
        values = torch.stack([(q & 15).long() - 8, (q >> 4).long() - 8], dim=-1).reshape(37, width)
        weight = values.double() * scale.double().repeat_interleave(group, dim=1)
        x = torch.randn(5, width, generator=gen).to(row_dtype)
        y = kernel()(x, q, scale, 4, group)
        assert y.dtype == torch.float32
        exact = x.double() @ weight.T
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
        # out_dtype: the same float32 sums rounded once to bfloat16 in the kernel, as Tensor.to rounds them
        assert torch.equal(kernel()(x, q, scale, 4, group, torch.bfloat16), y.to(torch.bfloat16))
        for i in range(5):
            assert torch.equal(kernel()(x[i : i + 1], q, scale, 4, group), y[i : i + 1]), (group, width, i, row_dtype)


def test_stacked_projections_equal_their_parts(ckpts):
    """Loading stacks q|k|v and gate|up (``layers.stack_weights``): int weights into one IntWeight whose
    rows are the parts' (each part now a view of its rows, nothing held twice), float weights into one
    tensor. The kernel sums each weight row alone, so the stack's product equals the parts' products
    side by side bit for bit, whichever rows are blocked together."""
    torch.manual_seed(1)
    for key in ("llama_int8", "llama_int4", "llama_float"):
        model = _model(ckpts[key])
        layer = model.model.layers[0]
        for block, parts in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            linears = [getattr(block, name) for name in parts]
            stack = block.stack.weight
            x = torch.randn(3, linears[0].weight.in_features if key != "llama_float" else stack.shape[1])
            if key == "llama_float":
                assert torch.equal(stack, torch.cat([m.weight for m in linears]))
                assert linears[0].weight.data_ptr() == stack.data_ptr()
                continue
            assert isinstance(stack, IntWeight) and stack.q.data_ptr() == linears[0].weight.q.data_ptr()
            assert torch.equal(stack(x), torch.cat([m.weight(x) for m in linears], dim=-1)), (key, parts)
            assert block.stack.rows == tuple(m.weight.q.shape[0] for m in linears)


def test_speculative_equals_plain_on_int_weights(ckpts):
    for key in ("llama_int4", "qwen3_5_int8"):
        model = _model(ckpts[key])
        plain = generate(model, PROMPT, 12, SamplingParams(), eos=set(), exact=True).tokens
        for k in (1, 3, 5):
            spec = speculative_generate(_model(ckpts[key], max_step_tokens=k + 1), PROMPT, 12, PromptLookup(1, 3), k,
                                        eos=set())
            assert spec.tokens == plain, (key, k)


def test_quantize_and_run_cli(ckpts, tmp_path):
    out = tmp_path / "q"
    proc = run_cli("quantize", str(ckpts["llama_float"]), "--format", "int4", "--group-size", "64", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    mlp = doc["groups"]["dense_mlp"]
    assert doc["layout"] == "compressed-tensors-int" and mlp["bytes_after"] * 32 == mlp["bytes_before"] * (4 + 16 / 64)
    assert mlp["bits_after"] == pytest.approx(4 + 16 / 64)
    assert 0 < doc["groups"]["dense_mlp"]["rel_rms"] < 0.2 and doc["top1_agreement"] > 0
    ids = ",".join(map(str, PROMPT))
    proc = run_cli("run", str(out), "--tp", "2", "--prompt-ids", ids, "--max-new-tokens", "8")
    assert proc.returncode == 2 and proc.stderr.strip() == (  # the plan check, before any rank starts
        "error: int4-g64 tensor 'model.layers.0.self_attn.o_proj.weight' would be split into 32-element slices of "
        "its 64 inputs at --tp 2 --ep 1, expected a multiple of 64 (whole blocks): use a smaller --tp, or quantize "
        "with a smaller --group-size"), proc.stderr
    proc = run_cli("run", str(out), "--tp", "1", "--prompt-ids", ids, "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    ref = dequantize_checkpoint(out, tmp_path / "ref")
    assert json.loads(proc.stdout)["tokens"] == generate(_model(ref), PROMPT, 8, SamplingParams()).tokens
    for args, message in (
        (("--format", "int4", "--group-size", "48"), "group size 48 (itself a multiple of 32)"),
        (("--format", "mxfp4", "--group-size", "64"), "--group-size applies to int8/int4"),
    ):
        proc = run_cli("quantize", str(ckpts["llama_float"]), *args, "--out", str(tmp_path / "bad"))
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _corrupt(src: Path, folder: Path, change) -> Path:
    folder.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    with safe_open(src / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("case", ["scale_dtype", "packed_dtype", "packed_shape"])
def test_bad_tensors_are_named(ckpts, tmp_path, case):
    name = "model.layers.1.self_attn.o_proj"

    def change(t):
        if case == "scale_dtype":
            t[f"{name}.weight_scale"] = t[f"{name}.weight_scale"].to(torch.int32)
        elif case == "packed_dtype":
            t[f"{name}.weight_packed"] = t[f"{name}.weight_packed"].view(torch.uint8)
        else:
            t[f"{name}.weight_packed"] = t[f"{name}.weight_packed"][:, :-1].contiguous()

    folder = _corrupt(ckpts["llama_int4"], tmp_path / case, change)
    with pytest.raises(ShardwiseError, match=rf"int-quantized checkpoint tensor '{name}\.weight_(scale|packed)' has "):
        _model(folder)


def test_kernel_builds_past_a_lock_left_by_a_killed_build(tmp_path):
    """torch's build waits forever on a lock file a killed build left behind (a rank killed while
    loading); the kernel's own build clears it under an flock and builds (fresh build folder)."""
    code = """
import torch
from shardwise.runtime import int_matmul
build = int_matmul.build_dir()
build.mkdir(parents=True)
(build / 'lock').write_text('')
op = int_matmul.kernel()
q = torch.ones(4, 32, dtype=torch.int8)
print(op(torch.ones(1, 32), q, torch.ones(4, 1), 8, 32).tolist())
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[32.0, 32.0, 32.0, 32.0]]"


@pytest.mark.parametrize(("width", "group"), [(2048, 2048), (100, 100), (45, 45), (256, 32), (384, 128)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_kernel_bfloat16_rows_times_8_bit_weights(width, group, scale_dtype):
    """bfloat16 rows times int8 weights (per channel, any width a tensor-parallel slice leaves, or groups of
    32 and more): the exact product to float32 rounding, row by row whatever the batch, and the float32
    path's result to float32 rounding."""
    from shardwise.runtime.int_matmul import kernel

    gen = torch.Generator().manual_seed(width + group)
    q = torch.randint(-128, 128, (37, width), dtype=torch.int8, generator=gen)
    scale = (torch.rand(37, width // group, generator=gen) * 0.1 + 0.01).to(scale_dtype)
    weight = q.double() * scale.double().repeat_interleave(group, dim=1)
    x = torch.randn(5, width, generator=gen).to(torch.bfloat16)
    y = kernel()(x, q, scale, 8, group)
    assert y.dtype == torch.float32
    bound = 1e-6 * (x.double().abs() @ weight.abs().T)  # float32 sums of exact products
    assert bool(((y.double() - x.double() @ weight.T).abs() <= bound).all())
    assert torch.equal(kernel()(x, q, scale, 8, group, torch.bfloat16), y.to(torch.bfloat16))
    assert bool(((y - kernel()(x.float(), q, scale, 8, group)).double().abs() <= 2 * bound).all())
    for i in range(5):
        assert torch.equal(kernel()(x[i : i + 1], q, scale, 8, group), y[i : i + 1]), (width, group, i)
