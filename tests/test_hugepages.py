"""``runtime.hugepages``: a loaded model's large weights are moved into 2 MB pages — the kernel really
backs them with huge pages (``/proc/self/smaps``), every value, view, stack and tie is what it was, small
weights stay put — and a checkpoint loaded that way still matches transformers."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from shardwise.runtime import hugepages
from shardwise.runtime.layers import join_rows


def huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``address``."""
    inside = False
    for line in open("/proc/self/smaps"):
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping of this process holds {address:#x}")


class Weights(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.big = nn.Linear(1024, 1024, bias=False)  # 4 MB
        self.tied = nn.Linear(1024, 1024, bias=False)
        self.tied.weight = self.big.weight
        self.small = nn.Linear(64, 64, bias=False)  # 16 KB: stays
        self.mid = nn.Linear(256, 256, bias=False)  # 256 KB (under a huge page, like an int4 model's scales): moves
        self.a, self.b = nn.Linear(512, 700, bias=False), nn.Linear(512, 900, bias=False)  # joined: 3.3 MB
        for p in self.parameters():
            p.requires_grad_(False).copy_(torch.randn(p.shape, generator=gen))
        self.register_buffer("cache", torch.zeros(1024, 1024))  # written at run time: stays


def test_place_moves_large_weights_and_keeps_every_relation():
    model = Weights()
    stack = join_rows([model.a.weight, model.b.weight])
    model.stack = type("Stack", (), {"weight": stack})()
    before = {name: p.clone() for name, p in model.named_parameters()}
    small_ptr, cache_ptr = model.small.weight.data_ptr(), model.cache.data_ptr()
    moved = hugepages.place(model)
    if not hugepages.available():
        assert moved == 0
        return
    assert moved == 4 * 1024 * 1024 + 1600 * 512 * 4 + 256 * 256 * 4
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.tied.weight is model.big.weight
    assert model.small.weight.data_ptr() == small_ptr and model.cache.data_ptr() == cache_ptr
    assert model.a.weight.data_ptr() == stack.data_ptr()
    assert model.b.weight.data_ptr() == stack.data_ptr() + 700 * 512 * 4
    assert stack.untyped_storage().data_ptr() == model.big.weight.untyped_storage().data_ptr()  # one mapping
    assert huge_kb(model.big.weight.data_ptr()) >= 2048
    assert model.mid.weight.untyped_storage().data_ptr() == model.big.weight.untyped_storage().data_ptr()
    stack.mul_(1.0)  # still a writable tensor
    assert torch.equal(model.b.weight, before["b.weight"])


def test_nothing_moves_without_large_cpu_weights():
    assert hugepages.place(nn.Linear(16, 16)) == 0
    assert hugepages.arena(0) is None


def test_loaded_checkpoint_is_placed_and_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from runtime_checks import randomise
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.generate import generate
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config).eval()
    randomise(hf)
    hf.save_pretrained(tmp_path)
    prompt = [5, 99, 1000, 7, 4000, 12]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 6:]
    model = ShardedCausalLM(load_spec(tmp_path), ParallelPlan(), 0, torch.float32, max_seq_len=32)
    load_shard(model, tmp_path)
    if hugepages.available():
        assert huge_kb(model.lm_head.weight.data_ptr()) >= 2048
        assert model.lm_head.weight.untyped_storage().data_ptr() == model.model.embed_tokens.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        got = model.logits(torch.tensor([prompt]))[0]
    assert (got - want).abs().max().item() <= 1e-4
    assert generate(model, prompt, 8).tokens == greedy.tolist()
