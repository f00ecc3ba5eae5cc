"""Quantization formats the planner knows, with their real storage cost.

bits_per_weight counts every stored bit per weight, block scales included, so
weight bytes = params × bits_per_weight / 8. MXFP4 and NVFP4 figures come from the
codec modules' constants, so the planner and the codecs cannot disagree.
"""

from dataclasses import dataclass

from shardwise.errors import unknown_name
from shardwise.quant import gguf_mix, mxfp4_codec, nvfp4_codec
from shardwise.spec.tensors import MATMUL_GROUPS, TENSOR_GROUPS


PACKED_BLOCK_MAX = 256  # weights per scale of the largest 1-D block format


@dataclass(frozen=True)
class QuantFormat:
    """One storage format.

    bits_per_weight: stored bits per weight including scales (bits).
    block_size: weights sharing one scale, or None for unscaled formats.
    scale_bits: bits of each block scale (0 when there is none).
    """

    name: str
    bits_per_weight: float
    block_size: int | None
    scale_bits: int
    description: str
    source: str
    gguf_ftype: str | None = None  # a GGUF file type: llama.cpp types each tensor (quant.gguf_mix)

    @property
    def packed(self) -> bool:
        """True for a 1-D block format (MXFP4 32, NVFP4 16, int4 groups 128 along the input) that
        stays packed in memory; fp8's 128×128 tiles are decoded at load."""
        return self.block_size is not None and self.block_size <= PACKED_BLOCK_MAX

    @property
    def weight_only_int(self) -> bool:
        """True for the weight-only integer formats the runtime keeps packed in every group it
        quantizes (``runtime.int_matmul``; compressed-tensors pack-quantized)."""
        return self.name.startswith("int")

    @property
    def weights_only(self) -> bool:
        """True when a scheme in this format quantizes matmul weights only: the group's biases and
        1-D parameters keep the float dtype (the packed block formats and the int formats)."""
        return self.packed or self.weight_only_int

    @property
    def groups(self) -> tuple[str, ...]:
        """The tensor groups this format sets when it is given for every weight: all of them for a
        GGUF file type (llama.cpp types the embedding and LM head too: ``quant.gguf_mix``), else the
        matmul groups."""
        return TENSOR_GROUPS if self.gguf_ftype else MATMUL_GROUPS

    def weight_bytes(self, params: int) -> float:
        """Bytes to store params weights in this format."""
        return params * self.bits_per_weight / 8


_OCP_MX = (
    "OCP Microscaling Formats (MX) Specification v1.0, "
    "https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf"
)
_GGML = "ggml ggml-common.h (https://github.com/ggml-org/ggml/blob/master/src/ggml-common.h)"

_FORMATS = (
    QuantFormat(
        "bf16", 16.0, None, 0, "bfloat16: 1 sign, 8 exponent, 7 mantissa bits (float32's range)",
        "Google Brain bfloat16; Intel BFLOAT16 Hardware Numerics Definition (2018)",
    ),
    QuantFormat("fp16", 16.0, None, 0, "IEEE 754 binary16", "IEEE 754-2008 binary16"),
    QuantFormat("fp32", 32.0, None, 0, "IEEE 754 binary32", "IEEE 754-2008 binary32"),
    QuantFormat(
        "fp8",
        8 + 32 / (128 * 128),
        128 * 128,
        32,
        "FP8 E4M3 weights with one fp32 scale per 128x128 block (8 + 32/16384 ≈ 8.002 bits); "
        "per-channel or 1x128 activation-style scales would cost ≈ 8.25 bits",
        "DeepSeek-V3 config.json quantization_config: quant_method fp8, fmt e4m3, weight_block_size [128, 128] "
        "(https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json)",
    ),
    QuantFormat(
        "mxfp4",
        mxfp4_codec.ELEMENT_BITS + mxfp4_codec.SCALE_BITS / mxfp4_codec.BLOCK_SIZE,
        mxfp4_codec.BLOCK_SIZE,
        mxfp4_codec.SCALE_BITS,
        f"{mxfp4_codec.BLOCK_SIZE} FP4 E2M1 elements share one E8M0 scale byte",
        _OCP_MX,
    ),
    QuantFormat(
        "nvfp4",
        nvfp4_codec.ELEMENT_BITS + nvfp4_codec.SCALE_BITS / nvfp4_codec.BLOCK_SIZE,
        nvfp4_codec.BLOCK_SIZE,
        nvfp4_codec.SCALE_BITS,
        f"{nvfp4_codec.BLOCK_SIZE} FP4 E2M1 elements share one FP8 E4M3 scale, plus one {nvfp4_codec.GLOBAL_SCALE_BITS}-bit "
        "fp32 scale per tensor (negligible per weight)",
        "NVIDIA, Introducing NVFP4 for Efficient and Accurate Low-Precision Inference "
        "(https://developer.nvidia.com/blog/introducing-nvfp4-for-efficient-and-accurate-low-precision-inference/); "
        "TensorRT Model Optimizer NVFP4QTensor",
    ),
    QuantFormat(
        "int8",
        8.0,
        None,
        0,
        "INT8 weights, symmetric, one bfloat16 scale per output row (weight-only W8A16): 8 bits plus 16/in "
        "per weight for the row scales (0.004 at 4096 inputs), which the planner leaves out",
        "compressed-tensors pack-quantized, strategy channel (llm-compressor W8A16 scheme; "
        "https://github.com/vllm-project/compressed-tensors); shardwise.quant.int_codec",
    ),
    QuantFormat(
        "int4-g32",
        4 + 16 / 32,
        32,
        16,
        "INT4 weights, symmetric, one bfloat16 scale per 32 weights (4.5 bits, as GGUF Q4_0)",
        "compressed-tensors pack-quantized, strategy group 32; shardwise.quant.int_codec",
    ),
    QuantFormat(
        "int4-g64",
        4 + 16 / 64,
        64,
        16,
        "INT4 weights, symmetric, one bfloat16 scale per 64 weights (4.25 bits)",
        "compressed-tensors pack-quantized, strategy group 64; shardwise.quant.int_codec",
    ),
    QuantFormat(
        "int4-g128",
        4 + 16 / 128,
        128,
        16,
        "INT4 weights with one 16-bit scale per 128 weights (symmetric, 4.125 bits); "
        "asymmetric GPTQ/AWQ with a 16-bit zero point per group costs 4.25 bits",
        "Frantar et al., GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers, "
        "arXiv:2210.17323",
    ),
    QuantFormat(
        "q4_0",
        18 * 8 / 32,
        32,
        16,
        "GGUF block_q4_0: fp16 scale + 32 4-bit weights = 18 bytes per 32 weights",
        f"{_GGML}, struct block_q4_0",
    ),
    QuantFormat(
        "q8_0",
        34 * 8 / 32,
        32,
        16,
        "GGUF block_q8_0: fp16 scale + 32 int8 weights = 34 bytes per 32 weights",
        f"{_GGML}, struct block_q8_0",
    ),
    QuantFormat(
        "mlx-mixed-3.6",
        3.578,
        64,
        32,
        "MLX mixed-precision quantization (mlx_lm.convert --quant-predicate: most matrices 3-bit, sensitive ones "
        "4-6-bit; group-64 fp16 scale and bias): 3.578 bits per weight over the model as its card states",
        "https://huggingface.co/spicyneuron/Kimi-K2.6-MLX-3.3bit README, 'Benchmarks' table, 3.6-bit column "
        "(stated bits per weight 3.578)",
    ),
    QuantFormat(
        "mxfp8",
        8 + 8 / 32,
        32,
        8,
        "32 FP8 (E4M3 or E5M2) elements share one E8M0 scale byte",
        _OCP_MX,
    ),
)

_GGUF_MIXES = (  # (file type, what llama.cpp's quantizer does beyond the default type)
    ("Q2_K", "attn_v Q4_K (GQA >= 4) or Q3_K, ffn_down and attn_output Q3_K; LM head Q6_K"),
    ("Q3_K_S", "Q3_K throughout; LM head Q6_K"),
    ("Q3_K_M", "attn_v Q5_K in the first two layers then Q4_K, ffn_down Q5_K in the first 1/16 then Q4_K, "
               "attn_output Q4_K; LM head Q6_K"),
    ("Q3_K_L", "attn_v, ffn_down and attn_output Q5_K; LM head Q6_K"),
    ("Q4_0", "Q4_0 throughout; LM head Q6_K"),
    ("Q4_K_S", "attn_v Q5_K in the first four layers, ffn_down Q5_K in the first 1/8; LM head Q6_K"),
    ("Q4_K_M", "attn_v and ffn_down Q6_K in the first and last 1/8 of the layers and every third between; "
               "LM head Q6_K"),
    ("Q5_K_S", "Q5_K throughout; LM head Q6_K"),
    ("Q5_K_M", "attn_v and ffn_down Q6_K in the first and last 1/8 of the layers and every third between; "
               "LM head Q6_K"),
    ("Q6_K", "Q6_K throughout"),
    ("Q8_0", "Q8_0 throughout, the LM head too"),
    ("MXFP4_MOE", "routed experts MXFP4, every other matrix (embedding and LM head too) Q8_0: the file type of "
                  "ggml-org's gpt-oss GGUFs (gpt-oss-20b-mxfp4.gguf 12.1 GB, gpt-oss-120b 63.4 GB on their "
                  "Hugging Face pages; the planner's bytes: 12.10 and 63.37 GB)"),
)


def _gguf_format(ftype: str, rules: str) -> QuantFormat:
    default = gguf_mix.FTYPE_DEFAULT[ftype]
    per_block, nbytes = gguf_mix.GGML_TYPES[default]
    return QuantFormat(
        f"gguf-{ftype.lower()}", gguf_mix.bits(default), per_block, 16 if default != "MXFP4" else 8,
        f"GGUF file type {ftype} as llama.cpp's quantizer writes it: {default} ({nbytes} bytes per {per_block} "
        f"weights) by default; {rules}; the LM head Q8_0 when its rows are not whole blocks, a tied embedding "
        "as the LM head, norms and router F32. Priced per tensor for each model (quant.gguf_mix); the bits "
        "here are the default type's",
        f"{_GGML}; ggml-org/llama.cpp src/llama-quant.cpp (llama_tensor_get_type_impl)", ftype,
    )


FORMATS: dict[str, QuantFormat] = {f.name: f for f in _FORMATS + tuple(_gguf_format(*m) for m in _GGUF_MIXES)}
"""Every known format by name."""


def get_format(name: str) -> QuantFormat:
    """The format called name; unknown names raise ShardwiseError with suggestions."""
    try:
        return FORMATS[name]
    except KeyError:
        raise unknown_name("quantization format", name, FORMATS) from None
