"""Every bundled model config: it parses, its bytes are the ones models/SOURCES.md records (git blob
id), the published totals SOURCES.md lists hold for the planner's count to the source's rounding, and
the measurement names the model aliases target resolve to the intended catalog keys."""

import csv
import hashlib
import re
from decimal import Decimal
from importlib import resources
from pathlib import Path

import pytest

from shardwise.perf.measurements import match_alias
from shardwise.spec.parse import catalog_models, load_model

MODELS = resources.files("shardwise.spec.catalog.models")
SOURCES = MODELS.joinpath("SOURCES.md").read_text()
MEASUREMENTS = Path(__file__).resolve().parents[1] / "data" / "measurements.csv"
NO_BLOB = {"olmoe-1b-7b-0125-instruct"}  # copied as text from a code search, no blob id (see SOURCES.md)


def git_blob(data: bytes) -> str:
    """git's blob id of a file's bytes (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def source_rows() -> dict[str, list[str]]:
    """The file table of SOURCES.md: key -> its cells."""
    rows = {}
    for line in SOURCES.splitlines():
        m = re.match(r"\| ([\w.\-]+)\.json \|", line)
        if m:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            assert m.group(1) not in rows, f"two SOURCES.md rows for {m.group(1)}"
            rows[m.group(1)] = cells
    return rows


def published_totals() -> dict[str, str]:
    """key -> printed total ("46.7B"), from the table of totals checked per catalog key."""
    section = SOURCES.split("### Totals checked per catalog key", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        m = re.match(r"\| ([\w.\-]+) \| ([\d.]+[BT]) \|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


ROWS = source_rows()


def test_git_blob_is_git_hash_object():
    assert git_blob(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_the_catalog_has_44_models_each_with_one_sources_row():
    keys = catalog_models()
    assert len(keys) >= 44
    assert set(keys) == set(ROWS), (set(keys) ^ set(ROWS))


@pytest.mark.parametrize("key", catalog_models())
def test_config_parses(key):
    spec = load_model(key)
    assert spec.total_params > 0 and spec.num_layers == len(spec.layers)


@pytest.mark.parametrize("key", sorted(set(catalog_models()) - NO_BLOB))
def test_bytes_are_the_recorded_blob(key):
    recorded = ROWS[key][3]
    assert re.fullmatch(r"[0-9a-f]{8,40}", recorded), (key, recorded)
    data = MODELS.joinpath(f"{key}.json").read_bytes()
    assert git_blob(data).startswith(recorded), (key, git_blob(data), recorded)


def test_rows_without_a_blob_are_the_known_ones():
    assert {k for k, cells in ROWS.items() if not re.fullmatch(r"[0-9a-f]{8,40}", cells[3])} == NO_BLOB


def test_published_totals_table_is_read():
    totals = published_totals()
    assert len(totals) >= 8 and totals["mixtral-8x7b-v0.1"] == "46.7B"


@pytest.mark.parametrize("key,printed", sorted(published_totals().items()))
def test_published_total_matches_to_its_rounding(key, printed):
    value, unit = Decimal(printed[:-1]), {"B": Decimal(10) ** 9, "T": Decimal(10) ** 12}[printed[-1]]
    half_unit = Decimal(1).scaleb(value.as_tuple().exponent) / 2 * unit
    total = load_model(key).total_params
    assert abs(Decimal(total) - value * unit) <= half_unit, (key, total, printed)


# Measurement names (data/measurements.csv, column model) -> the catalog key their alias must give.
ALIASED = {
    "LLaMA-2 7B": "llama-2-7b",
    "LLaMA-2 70B": "llama-2-70b",
    "Qwen3.6-27B": "qwen3.5-27b",
    "Qwen3.5-122B-A10B": "qwen3.5-122b-a10b",
    "DeepSeek R1 671B": "deepseek-r1",
    "DeepSeek-R1": "deepseek-r1",
    "DeepSeek V3.1": "deepseek-v3.1",
    "Llama 3.2 3B Instruct": "llama-3.2-3b-instruct",
    "Qwen2.5-Coder-7B": "qwen2.5-coder-7b-instruct",
}


@pytest.mark.parametrize("name,key", sorted(ALIASED.items()))
def test_measurement_names_resolve_to_their_keys(name, key):
    with MEASUREMENTS.open(newline="") as f:
        assert name in {row["model"] for row in csv.DictReader(f)}, name
    entry = match_alias("models", name)
    assert entry is not None and entry["key"] == key, (name, entry)
    assert key in catalog_models()


def test_other_names_do_not_fall_into_the_new_aliases():
    assert match_alias("models", "DeepSeek-R1-Distill-Qwen-32B")["key"] == "deepseek-r1-distill-qwen-32b"
    assert match_alias("models", "Llama 3.3 70B")["key"] == "llama-3.3-70b-instruct"
    assert match_alias("models", "Llama 3 70B")["key"] == "llama-3.1-70b"
    assert match_alias("models", "Qwen3-Coder-30B-A3B-Instruct")["key"] == "qwen3-30b-a3b"
    assert match_alias("models", "Qwen2.5-Coder-14B") is None  # no bundled config: unresolved, not guessed
    assert match_alias("models", "Llama 3.2 3B")["key"] == "llama-3.2-3b"  # base, not the Instruct file
    assert match_alias("models", "llama3.2:3b")["key"] == "llama-3.2-3b-instruct"  # Ollama's tag is Instruct
    assert match_alias("models", "deepseek-r1:70b")["key"] == "deepseek-r1-distill-llama-70b"
    assert match_alias("models", "deepseek-r1:7b")["key"] == "deepseek-r1-distill-qwen-7b"
    assert match_alias("models", "deepseek-r1:14b") is None  # a distill with no bundled config, not the 671B model
    assert match_alias("models", "deepseek-r1:671b")["key"] == "deepseek-r1"
    assert match_alias("models", "deepseek-r1:8b")["key"] == "deepseek-r1-distill-llama-8b"
    assert match_alias("models", "Phi-4-reasoning")["key"] == "phi-4"
    assert match_alias("models", "phi4-mini") is None  # another model (3.8 B): not Phi-4's file
    assert match_alias("models", "Mistral 7B")["key"] == "mistral-7b-v0.1"
    assert match_alias("models", "mistral:7b")["key"] == "mistral-7b-instruct-v0.3"  # Ollama's tag is v0.3
    assert match_alias("models", "Gemma 2 27B") is None  # no bundled config
    assert match_alias("models", "GLM-4.5-Air")["key"] == "glm-4.5-air"
    assert match_alias("models", "GLM-4.6")["key"] == "glm-4.5"  # same planned weights (aliases.toml's note)
    assert match_alias("models", "GLM-4.5V") is None  # the vision model: another architecture
    assert match_alias("models", "qwen3:4b")["key"] == "qwen3-4b"
    assert match_alias("models", "qwen2.5:0.5b")["key"] == "qwen2.5-0.5b"


def test_new_families_count_their_own_tensors():
    # Qwen2.5-7B: q/k/v biases, no o_proj bias; 28 layers, hidden 3584, 28 heads / 4 KV heads of 128
    h, kv, inter, vocab, n = 3584, 4 * 128, 18944, 152064, 28
    layer = h * h * 2 + 2 * kv * h + h + 2 * kv + 3 * h * inter + 2 * h
    assert load_model("qwen2.5-7b").total_params == n * layer + 2 * vocab * h + h
    # Qwen3-8B: per-head q/k RMSNorm (2 x 128 per layer) on top of the llama shapes
    q3 = load_model("qwen3-8b")
    assert sum(t.numel for t in q3.layers[0].tensors if "_norm." in t.name) == 2 * 128
    # Mistral-7B-v0.1 slides every layer over 4096 tokens; Mixtral 8x7B: 8 experts, top 2, no shared expert
    assert {(lay.attention, lay.window) for lay in load_model("mistral-7b-v0.1").layers} == {("sliding", 4096)}
    mx = load_model("mixtral-8x7b-v0.1")
    assert (mx.moe.num_experts, mx.moe.top_k, mx.moe.shared_experts) == (8, 2, 0)
    # Qwen3.5-27B is dense (no MoE) with 3 Gated DeltaNet layers per gated-attention layer
    q35 = load_model("qwen3.5-27b")
    kinds = [lay.attention for lay in q35.layers]
    assert q35.moe is None and kinds.count("gated_deltanet") == 3 * kinds.count("gated_attention") == 48


def test_llama_3_2_ties_its_head_and_caches_as_vllm_measured():
    # Llama-3.2-3B-Instruct ties the LM head to the embedding (no second vocab x hidden matrix): 28 layers,
    # hidden 3072, 24 query / 8 KV heads of 128, intermediate 8192, vocab 128256
    h, kv, inter, vocab, n = 3072, 8 * 128, 8192, 128256, 28
    layer = 2 * h * h + 2 * kv * h + 3 * h * inter + 2 * h
    m = load_model("llama-3.2-3b-instruct")
    assert m.total_params == n * layer + vocab * h + h == 3_212_749_824
    # 28 layers x (K + V) x 8 heads x 128 x 2 bytes: the 114,688 B/token that vLLM's own KV sizing reproduces
    # (13.87 GiB for 129,888 tokens; see the llama-3.2-3b-instruct row of models/SOURCES.md)
    assert m.cache_bytes_per_token() == 114_688
    assert load_model("llama-3.2-1b").total_params == load_model("llama-3.2-1b-instruct").total_params


def test_r1_distill_qwen_7b_ignores_its_unused_sliding_window():
    # sliding_window 4096 but use_sliding_window false: all 28 layers keep the whole context,
    # 28 x (K + V) x 4 KV heads x 128 x 2 bytes a token
    m = load_model("deepseek-r1-distill-qwen-7b")
    assert {(lay.attention, lay.window) for lay in m.layers} == {("gqa", None)}
    assert m.cache_bytes(100_000) == 100_000 * 28 * 2 * 4 * 128 * 2
