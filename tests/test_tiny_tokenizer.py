"""The tiny checkpoints' tokenizer: a byte-level BPE trained at make-checkpoint time, with a ChatML
chat template that ``transformers.AutoTokenizer`` applies, so chat messages become a prompt the
default checkpoint answers with text (what a future ``shardwise serve`` with no arguments needs)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import get_default_build_root

from conftest import run_cli
from shardwise.plan import ParallelPlan
from shardwise.runtime.checkpoint import CHAT_TEMPLATE, default_checkpoint, make_checkpoint
from shardwise.runtime.generate import SamplingParams, encode_prompt, generate, load_tokenizer
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM

transformers = pytest.importorskip("transformers")

MESSAGES = [
    {"role": "system", "content": "You are a tiny model."},
    {"role": "user", "content": "Hello world! How do experts split across boxes?"},
]
CHATML = ("<|im_start|>system\nYou are a tiny model.<|im_end|>\n"
          "<|im_start|>user\nHello world! How do experts split across boxes?<|im_end|>\n"
          "<|im_start|>assistant\n")
TEXTS = ("Hello world", "The key-value cache grows with the context.", "  two spaces, a\ttab and\nnew lines\n",
         "Ünïcödé, 日本語, emoji 🦙 and symbols <>{}[]", "<|im_start|>user\nhi<|im_end|>\n")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_checkpoint("llama-3.1-8b", "tiny", tmp_path_factory.mktemp("llama"), seed=3)


def _ids(encoded) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template; 4.x a list."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_files_and_vocabulary(llama):
    config = json.loads((llama / "config.json").read_text())
    tok_config = json.loads((llama / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    tok = load_tokenizer(llama)
    vocab = tok.get_vocab(with_added_tokens=True)
    assert len(vocab) <= config["vocab_size"] and max(vocab.values()) < config["vocab_size"]
    # the model's special ids are the tokenizer's; the ChatML markers are the last two ids
    assert [config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [
        vocab[t] for t in ("<|bos|>", "<|eos|>", "<|pad|>")]
    assert (vocab["<|im_start|>"], vocab["<|im_end|>"]) == (config["vocab_size"] - 2, config["vocab_size"] - 1)


def test_trained_the_same_every_time(llama, tmp_path):
    """Deterministic: another model and another weight seed give the same tokenizer files."""
    other = make_checkpoint("qwen3-30b-a3b", "tiny", tmp_path / "q", seed=11)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        mine, theirs = json.loads((llama / name).read_text()), json.loads((other / name).read_text())
        if name == "tokenizer_config.json":  # the models' context lengths differ
            mine.pop("model_max_length"), theirs.pop("model_max_length")
        assert mine == theirs, name


def test_auto_tokenizer_chat_template_and_round_trip(llama):
    tok = transformers.AutoTokenizer.from_pretrained(llama)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == CHATML
    ids = _ids(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 3 and ids.count(end) == 2 and ids[0] == start  # markers are single tokens
    assert ids == tok.encode(CHATML) == encode_prompt(llama, CHATML)  # transformers == tokenizers
    assert tok.decode(ids) == CHATML
    assert tok.decode(ids, skip_special_tokens=True) == CHATML.replace("<|im_start|>", "").replace("<|im_end|>", "")
    # content given as OpenAI text parts renders the same
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    assert tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == CHATML
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == CHATML.removesuffix("<|im_start|>assistant\n")
    for t in TEXTS:
        assert tok.decode(tok.encode(t)) == t, t
        assert load_tokenizer(llama).decode(encode_prompt(llama, t), skip_special_tokens=False) == t, t


def _fresh_cache(tmp_path, monkeypatch) -> None:
    """An empty ``$XDG_CACHE_HOME`` for the checkpoint cache; the compiled ops keep the machine's build
    cache (torch's build root follows ``$XDG_CACHE_HOME``: each test would compile them again, ~20 s)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


def test_default_checkpoint_answers_a_chat_with_text(tmp_path, monkeypatch):
    """The default checkpoint, built fresh, turns a chat into ids and its reply into text."""
    _fresh_cache(tmp_path, monkeypatch)
    folder = default_checkpoint()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = _ids(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    spec = load_spec(folder)
    model = ShardedCausalLM(spec, ParallelPlan(tp=1, ep=1), 0, torch.float32, max_seq_len=128)
    load_shard(model, folder)
    result = generate(model, ids, 12, SamplingParams(), eos={tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id})
    reply = tok.decode(result.tokens, skip_special_tokens=True)
    assert result.tokens and isinstance(reply, str)
    assert tok.decode(ids + result.tokens).startswith(CHATML)


def test_old_cached_default_gets_the_chat_template(tmp_path, monkeypatch):
    """A default checkpoint cached before the chat template (no tokenizer_config.json nor
    generation_config.json, the old 512-id tokenizer) gets the current tokenizer files; config and
    weights are left as they were."""
    _fresh_cache(tmp_path, monkeypatch)
    fresh = default_checkpoint()
    expected = {n: (fresh / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json",
                                                      "generation_config.json")}
    weights = (fresh / "model.safetensors").read_bytes()
    (fresh / "tokenizer_config.json").unlink()
    (fresh / "generation_config.json").unlink()
    (fresh / "tokenizer.json").write_text("{}")  # whatever was there is replaced
    assert default_checkpoint() == fresh
    assert {n: (fresh / n).read_bytes() for n in expected} == expected
    assert (fresh / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in fresh.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    tok = transformers.AutoTokenizer.from_pretrained(str(fresh))
    stops = json.loads((fresh / "generation_config.json").read_text())["eos_token_id"]
    assert stops == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


def test_cli_run_default_prompt_text(tmp_path, monkeypatch):
    """`shardwise run --prompt hello` on the default checkpoint (built in a fresh cache)."""
    _fresh_cache(tmp_path, monkeypatch)
    proc = run_cli("run", "--prompt", "hello", "--max-new-tokens", "5", "--json")  # inherits both variables
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["plan"]["tp"] == 2 and 1 <= len(doc["tokens"]) <= 5
    assert (tmp_path / "shardwise" / "tiny-qwen3-moe" / "tokenizer_config.json").exists()
    shutil.rmtree(tmp_path / "shardwise", ignore_errors=True)
