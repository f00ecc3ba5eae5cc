"""GGUF file types priced per tensor (``quant.gguf_mix``) against files llama.cpp's own quantizer writes.

A small llama (hidden 256 so K-quant rows are whole 256-weight blocks, an MLP width of 352 so
``ffn_down``'s rows are not and fall back to a 32-wide type, 16 layers so the "more bits" layers of
Q4_K_M / Q5_K_M are a proper subset, GQA 4) is written as an F32 GGUF the way llama.cpp's converter
writes it (``shardwise.testing.llama_gguf``) and quantized by ``llama_cpp.llama_model_quantize`` to
each file type. Every tensor's ggml type in the file equals ``gguf_mix.tensor_types``, and the
file's tensor bytes equal ``ModelSpec.weight_bytes`` at ``gguf_mix.group_bits``; a tied-embedding
variant checks that the embedding takes the LM head's type. llama-cpp-python is built by
``.ci/run``; without it (or the ``gguf`` package) the llama.cpp tests skip.
"""

from __future__ import annotations

import pytest

from shardwise.errors import ShardwiseError
from shardwise.quant import gguf_mix
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.loader import load_spec
from shardwise.spec.parse import load_model

FTYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0")
SHAPE = dict(hidden_size=256, intermediate_size=352, num_hidden_layers=16, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64)


def _gguf_name(hf: str) -> str:
    from shardwise.testing.llama_gguf import _NAMES, _TOP

    if hf in _TOP:
        return _TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def f32_gguf(request, tmp_path_factory):
    pytest.importorskip("gguf", reason="the gguf package is not installed (.ci/run installs it)")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (.ci/run builds it)")
    from shardwise.testing.llama_gguf import write_llama_gguf

    folder = tmp_path_factory.mktemp("gguf-mix")
    checkpoint = make_checkpoint("llama-3.1-8b", "tiny", folder / "ck", seed=1,
                                 overrides=dict(SHAPE, tie_word_embeddings=request.param))
    return load_spec(checkpoint), write_llama_gguf(checkpoint, folder / "f32.gguf", "f32")


@pytest.mark.parametrize("ftype", FTYPES)
def test_every_tensor_type_and_byte_equals_llama_cpp_quantizer(f32_gguf, ftype, tmp_path):
    import llama_cpp
    from gguf import GGUFReader

    spec, f32 = f32_gguf
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), 1
    out = tmp_path / f"{ftype}.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) == 0
    written = {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(str(out)).tensors
               if t.name != "rope_freqs.weight"}  # llama3 rope factors: not a model weight
    ours = {_gguf_name(t.name): ggml for t, _, ggml in gguf_mix.tensor_types(spec, ftype)}
    assert ours == {name: kind for name, (kind, _) in written.items()}
    assert spec.weight_bytes(gguf_mix.group_bits(spec, ftype)) == pytest.approx(sum(n for _, n in written.values()))


def test_seventy_b_file_size_and_mix():
    """Llama-3.1-70B at Q4_K_M: 39.59 GiB of tensors, the size of the published file (bartowski's
    Meta-Llama-3.1-70B-Instruct-Q4_K_M.gguf, 42.5 GB), with Q6_K on the attn_v / ffn_down layers
    that get more bits and Q5_K on the other attn_v (llama.cpp's 70B rule: eight heads share them)."""
    model = load_model("llama-3.1-70b")
    size = model.weight_bytes(gguf_mix.group_bits(model, "q4_k_m"))
    assert size / 2**30 == pytest.approx(39.59, abs=0.05)
    kinds = {}
    for t, layer, ggml in gguf_mix.tensor_types(model, "Q4_K_M"):
        kinds.setdefault(t.name.rsplit(".", 2)[-2], set()).add(ggml)
    assert kinds["v_proj"] == {"Q5_K", "Q6_K"} and kinds["down_proj"] == {"Q4_K", "Q6_K"}
    assert kinds["q_proj"] == {"Q4_K"} and kinds["lm_head"] == {"Q6_K"} and kinds["embed_tokens"] == {"Q4_K"}


@pytest.mark.parametrize("name, published_gb", [("gpt-oss-20b", 12.1), ("gpt-oss-120b", 63.4)])
def test_mxfp4_moe_file_size(name, published_gb):
    """MXFP4_MOE (ggml-org's gpt-oss GGUFs): experts MXFP4, every other matrix Q8_0 (embedding and LM
    head too), vectors and the router F32: the published files' sizes (their Hugging Face pages, in
    GB), where the checkpoint's own BF16 beside the experts would be 1.7 GB (20b) and 1.9 GB (120b) more."""
    model = load_model(name)
    kinds = {}
    for t, _, ggml in gguf_mix.tensor_types(model, "MXFP4_MOE"):
        kinds.setdefault(t.group, set()).add(ggml)
    assert kinds["routed_experts"] >= {"MXFP4"} and kinds["attention"] >= {"Q8_0"} and kinds["router"] == {"F32"}
    assert kinds["lm_head"] == {"Q8_0"} and kinds["embedding"] == {"Q8_0"}
    assert model.weight_bytes(gguf_mix.group_bits(model, "mxfp4_moe")) / 1e9 == pytest.approx(published_gb, abs=0.06)


def test_plan_prices_the_mix_and_refuses_a_partial_one():
    """``plan --quant gguf-q4_k_m`` reads the mix's bytes (LM head at Q6_K, not bf16), and a GGUF
    file type given for one group only is refused in one line."""
    from conftest import cli_json, run_cli

    doc = cli_json("plan", "--model", "llama-3.1-8b", "--boxes", "1", "--box", "dgx-spark", "--quant", "gguf-q4_k_m")
    model = load_model("llama-3.1-8b")
    assert doc["memory"]["total_weight_bytes"] == pytest.approx(model.weight_bytes(gguf_mix.group_bits(model, "Q4_K_M")))
    assert set(doc["model"]["formats"].values()) == {"gguf-q4_k_m"}
    done = run_cli("plan", "--model", "qwen3-30b-a3b", "--boxes", "1", "--box", "dgx-spark", "--experts", "gguf-q4_k_m")
    assert done.returncode != 0 and "GGUF file type" in done.stderr and "Traceback" not in done.stderr


def test_unknown_file_type_is_named():
    with pytest.raises(ShardwiseError, match="GGUF file type"):
        gguf_mix.check_ftype("Q4_K_X")


def test_block_table_is_ggmls():
    """The type table equals the gguf package's GGML_QUANT_SIZES (ggml-common.h)."""
    gguf = pytest.importorskip("gguf")
    for name, size in gguf_mix.GGML_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == size
