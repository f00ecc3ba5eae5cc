"""Parse a Hugging Face config.json (or a bundled catalog key) into a ModelSpec.

The text model only: configs that wrap it (Kimi K3, Qwen3.5's vision-language wrapper) are read
through their ``text_config``. The family builders are in ``shardwise.spec.families``.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from shardwise.errors import ShardwiseError, shown, unknown_name
from shardwise.quant.formats import FORMATS
from shardwise.quant.layouts import int_scheme
from shardwise.spec.config_fields import Config, check_fields
from shardwise.spec.families import BUILDERS
from shardwise.spec.model import ModelSpec
from shardwise.spec.tensors import (
    ATTENTION,
    DENSE_MLP,
    EMBEDDING,
    LINEAR_ATTENTION,
    LM_HEAD,
    MATMUL_GROUPS,
    NORM,
    ROUTED_EXPERTS,
    SHARED_EXPERTS,
    TensorSpec,
)

_CATALOG_PACKAGE = "shardwise.spec.catalog.models"


def catalog_models() -> list[str]:
    """Keys of the bundled model configs (file names without .json)."""
    files = resources.files(_CATALOG_PACKAGE).iterdir()
    return sorted(p.name[: -len(".json")] for p in files if p.name.endswith(".json"))


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A ModelSpec from a catalog key (``kimi-k3``), a config.json path or a checkpoint folder."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ShardwiseError(f"model config '{path}' does not exist: pass a catalog key or a config.json path")
        config = read_json(path, "model config")
        try:
            return parse_config(config, name=path.parent.name if path.name == "config.json" else path.stem)
        except ShardwiseError as exc:
            raise ShardwiseError(f"model config '{path}': {exc}") from None
    key = str(name_or_path)
    known = catalog_models()
    if key not in known:
        raise unknown_name("model", key, known)
    text = resources.files(_CATALOG_PACKAGE).joinpath(f"{key}.json").read_text()
    return parse_config(json.loads(text), name=key)



def read_json(path: Path, what: str) -> Any:
    """A JSON file's document; one-line errors for a file that cannot be read, is not UTF-8 or not JSON."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ShardwiseError(f"{what} '{path}' cannot be read ({exc.strerror}): check the path") from None
    except UnicodeDecodeError as exc:
        raise ShardwiseError(f"{what} '{path}' is not UTF-8 text (byte {exc.start}): is it a JSON file?") from None
    except json.JSONDecodeError as exc:
        raise ShardwiseError(f"{what} '{path}' is not valid JSON (line {exc.lineno}): {exc.msg}") from None
    except (ValueError, RecursionError) as exc:  # a number past Python's digit limit, nesting past the stack
        raise ShardwiseError(f"{what} '{path}' is not JSON shardwise can read: {str(exc).splitlines()[0]}") from None


def parse_config(config: Mapping[str, Any], name: str = "model") -> ModelSpec:
    """Parse a Hugging Face config dict into a ModelSpec (raises ShardwiseError on bad input)."""
    if not isinstance(config, Mapping):
        raise ShardwiseError("config.json must be a JSON object")
    model_type = config.get("model_type")
    if model_type is None:
        raise ShardwiseError("config.json is missing 'model_type': this is not a Hugging Face model config")
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else None
    if model_type in ("kimi_k3", "qwen3_5_moe", "qwen3_5") and text is None:
        raise ShardwiseError(f"config.json ({model_type}) is missing 'text_config'")
    data = dict(text) if text is not None else dict(config)
    inner_type = data.get("model_type", model_type)
    builder = BUILDERS.get(inner_type) if isinstance(inner_type, str) else None
    builder = builder or (BUILDERS.get(model_type) if isinstance(model_type, str) else None)
    if builder is None:
        raise ShardwiseError(
            f"unsupported model_type {shown(model_type)}: shardwise reads {', '.join(BUILDERS)}"
        )
    check_fields(data)
    cfg = Config(data, model_type)
    spec_kwargs = builder(cfg)
    hidden = cfg.int("hidden_size")
    vocab = cfg.int("vocab_size")
    tie = bool(config.get("tie_word_embeddings", data.get("tie_word_embeddings", False)))
    prefix = spec_kwargs.pop("prefix", "model.")
    embed, final_norm = spec_kwargs.pop("global_names", (f"{prefix}embed_tokens.weight", f"{prefix}norm.weight"))
    globals_ = [TensorSpec(embed, (vocab, hidden), EMBEDDING, tp_dim=0, tp_pad=True)]
    globals_.append(TensorSpec(final_norm, (hidden,), NORM))
    globals_ += spec_kwargs.pop("extra_globals", ())  # e.g. Kimi K3's output attention residual
    if not tie:
        globals_.append(TensorSpec("lm_head.weight", (vocab, hidden), LM_HEAD, tp_dim=0, tp_pad=True))
    dtype = _dtype_name(data.get("torch_dtype") or data.get("dtype") or config.get("torch_dtype") or "bfloat16")
    qc = data.get("quantization_config") or config.get("quantization_config")
    quant_method, formats = _quant_formats(qc)
    if qc is not None and "quantization_config" not in data:  # a VL wrapper holds it beside text_config
        data = {**data, "quantization_config": qc}
    return ModelSpec(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=vocab,
        globals=tuple(globals_),
        tie_word_embeddings=tie,
        dtype=dtype,
        quant_formats=formats,
        quant_method=quant_method,
        # Kimi configs spell the context length model_max_length
        max_position_embeddings=cfg.get("max_position_embeddings") or cfg.get("model_max_length", 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        config=data,
        **spec_kwargs,
    )


def _dtype_name(value: str) -> str:
    value = str(value).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(value, "bf16")


def _int_format(qc: Mapping[str, Any]) -> str:
    """The formats-catalog name of a ``pack-quantized`` config's weights: int8 (per channel) or
    int{bits}-g{group}; a scheme the catalog lacks is a one-line error."""
    bits, group = int_scheme(qc)
    name = f"int{bits}" + (f"-g{group}" if group else "")
    if name not in FORMATS:
        raise ShardwiseError(
            f"quantization_config pack-quantized {bits}-bit weights with group size {group} are not in the formats "
            f"catalog: use int8 per channel or int4 with group 32, 64 or 128"
        )
    return name


# A representative module name per quantizable group: a group is quantized unless an ignore rule hits it.
_GROUP_PROBES = {
    ATTENTION: "model.layers.1.self_attn.o_proj",
    LINEAR_ATTENTION: "model.layers.1.self_attn.o_proj",
    DENSE_MLP: "model.layers.0.mlp.down_proj",
    SHARED_EXPERTS: "model.layers.1.mlp.shared_experts.down_proj",
    ROUTED_EXPERTS: "model.layers.1.mlp.experts.0.w2",
}
# NVIDIA ModelOpt's quant_algo -> the formats-catalog name of its weights (W4A16_NVFP4: NVFP4 weights,
# activations unquantized; the bytes are NVFP4's either way)
_MODELOPT_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4"}


def _modelopt_formats(qc: Mapping[str, Any]) -> dict[str, str]:
    """Formats of an NVIDIA ModelOpt export (``quant_method`` modelopt, as vLLM's ModelOpt configs read
    it): ``quant_algo`` for every matmul group its ``ignore`` (config.json) / ``exclude_modules``
    (hf_quant_config.json) glob patterns do not hit; other algorithms are a one-line error."""
    algo = qc.get("quant_algo")
    if algo not in _MODELOPT_ALGOS:
        raise ShardwiseError(f"quantization_config quant_algo {shown(algo)} (modelopt) is not supported: shardwise "
                             f"reads {', '.join(_MODELOPT_ALGOS)}")
    key = "ignore" if "ignore" in qc else "exclude_modules"
    patterns = qc.get(key) or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ShardwiseError(f"config.json field 'quantization_config.{key}' must be a list of module name patterns")
    return {g: _MODELOPT_ALGOS[algo] for g, probe in _GROUP_PROBES.items()
            if not any(fnmatch.fnmatchcase(probe, p) for p in patterns)}


def _quant_formats(qc: Mapping[str, Any] | None) -> tuple[str | None, dict[str, str]]:
    """Format per tensor group from a ``quantization_config`` (empty when unquantized)."""
    if not qc:
        return None, {}
    if not isinstance(qc, Mapping):
        raise ShardwiseError(f"config.json field 'quantization_config' must be an object, got {shown(qc)}")
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss: experts MXFP4, modules_to_not_convert stay BF16
        return method, {ROUTED_EXPERTS: "mxfp4"}
    if method == "fp8":  # DeepSeek-V3 block FP8: every linear except router, embeddings, head
        return method, {g: "fp8" for g in MATMUL_GROUPS}
    if method == "compressed-tensors":
        fmt = qc.get("format", "")
        if not isinstance(fmt, str):
            raise ShardwiseError(f"config.json field 'quantization_config.format' must be a string, got {shown(fmt)}")
        if "mxfp4" in fmt:
            name = "mxfp4"
        elif "nvfp4" in fmt:
            name = "nvfp4"
        elif "float-quantized" in fmt:
            name = "fp8"
        elif "pack-quantized" in fmt:
            name = _int_format(qc)
        else:
            raise ShardwiseError(f"quantization_config format '{fmt}' is not supported: use mxfp4, nvfp4 or fp8")
        rules = [p for p in qc.get("ignore", []) if isinstance(p, str)]
        # an int LM head runs packed (runtime.packed_weights) unless a rule keeps it float: llama.cpp-style files
        probes = {**_GROUP_PROBES, LM_HEAD: "lm_head"} if name.startswith("int") else _GROUP_PROBES
        formats = {g: name for g, probe in probes.items()
                   if not any(re.match(p[3:], probe) if p.startswith("re:") else p == probe for p in rules)}
        return method, formats
    if method == "modelopt":
        return method, _modelopt_formats(qc)
    raise ShardwiseError(
        f"quantization_config quant_method '{method}' is not supported: shardwise reads mxfp4, fp8, compressed-tensors, "
        "modelopt"
    )

