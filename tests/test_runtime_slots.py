"""Per-row cache slots and positions (``ShardedCausalLM.forward(ids, start, slots)``): continuous
batching is exact.

A little scheduler runs four sequences of different prompt lengths through ``max_batch`` = 3 cache
slots under ``exact.row_blocked()``: two start together (their prompts prefilled in chunks of
``CHUNK`` tokens, rows of the same chunk length in one call, later chunks at positions past 0), one
joins while they decode, one finishes early and a fourth waits for its slot, which first held a
longer sequence and was then filled with NaN (any read of a stale key would poison the output).
Every step decodes all running sequences in one call. Each sequence's tokens and the hidden states
of every call it took part in must be bit-identical (``torch.equal``) to that sequence run alone in
slot 0 of a fresh model through the one-sequence path (``slots=None``), with the same chunks: at
tp 1 for llama, qwen3_moe (MoE), deepseek_v3 (MLA), gpt_oss (sliding window 4, so rings wrap
while prefilling and decoding), kimi_linear (KDA + NoPE MLA) and qwen3_5_moe (Gated DeltaNet +
gated attention) — the linear-attention layers' recurrent state and conv window kept per slot —
and at tp 2 with expert parallelism (ep 2) for qwen3_moe. Then the one-line errors, and the
linear-attention state rolled back per slot after speculative-style passes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.exact import row_blocked
from shardwise.runtime.launch import launch_local

ARCHS = {  # catalog model → make_checkpoint overrides
    "llama-3.1-8b": {},
    "qwen3-30b-a3b": {},
    "deepseek-v3": {},
    "gpt-oss-20b": {"sliding_window": 4},
    "kimi-linear-48b-a3b": {},
    "kimi-k3": {},  # attention residuals, latent MoE, gated MLA: each row's mix runs alone
    "qwen3.5-397b-a17b": {},
}
MAX_BATCH, MAX_SEQ_LEN, CHUNK = 3, 24, 4
FREE = [2, 0, 1]  # the order slots are handed out: the first sequence runs in slot 2, not 0
_IDS = torch.randint(0, 200, (30,), generator=torch.Generator().manual_seed(5)).tolist()
SEQS = (  # (prompt, tokens to generate, first step it may join at)
    (_IDS[:8], 10, 0),  # chunks 0..3, 4..7, both batched with the next one's
    (_IDS[8:17], 3, 0),  # 12 positions, the longest slot user; finishes first
    (_IDS[17:20], 8, 1),  # joins while the first two decode, in the last free slot
    (_IDS[20:22], 7, 1),  # waits for the second one's slot, then reuses it from position 0
)


def _folder(root, key: str) -> str:
    return str(make_checkpoint(key, "tiny", root / key, seed=0, overrides=ARCHS[key]))


def _model(folder: str, plan: ParallelPlan, rank: int = 0):
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    model = ShardedCausalLM(load_spec(folder), plan, rank, torch.float32, max_seq_len=MAX_SEQ_LEN, max_batch=MAX_BATCH)
    load_shard(model, folder)
    return model


def _chunks(prompt: list[int]) -> list[tuple[int, list[int]]]:
    """(first position, tokens) of each prefill chunk."""
    return [(p, prompt[p : p + CHUNK]) for p in range(0, len(prompt), CHUNK)]


def _poison(model, slot: int) -> None:
    """NaN into every cache row of ``slot`` (KV, sliding rings, MLA latents)."""
    for layer in model.model.layers:
        for name, buf in layer.self_attn.named_buffers():
            if "cache" in name:
                buf[slot] = float("nan")


@torch.no_grad()
def _alone(model, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """A sequence run alone in slot 0 (``slots=None``), prefilled in ``CHUNK``s: (tokens, the hidden
    states of every call)."""
    hidden = []
    for start, chunk in _chunks(prompt):
        hidden.append(model(torch.tensor([chunk]), start)[0])
    tokens = [int(model.lm_head.greedy(hidden[-1][-1]))]
    while len(tokens) < new:
        hidden.append(model(torch.tensor([[tokens[-1]]]), len(prompt) + len(tokens) - 1)[0])
        tokens.append(int(model.lm_head.greedy(hidden[-1][-1])))
    return tokens, hidden


@torch.no_grad()
def _interleaved(model) -> tuple[list[list[int]], list[list[torch.Tensor]], list[int], int]:
    """``SEQS`` decoded together: (tokens, hidden states of every call, the slot each ran in, the
    most rows of one call)."""
    free, waiting, running = list(FREE), list(range(len(SEQS))), []
    tokens: list[list[int]] = [[] for _ in SEQS]
    hidden: list[list[torch.Tensor]] = [[] for _ in SEQS]
    slot_of, widest, step = [-1] * len(SEQS), 0, 0
    while waiting or running:
        joining = [i for i in waiting if SEQS[i][2] <= step][: len(free)]
        for i in joining:
            waiting.remove(i)
            slot_of[i] = free.pop(0)
        for c in range(max((len(_chunks(SEQS[i][0])) for i in joining), default=0)):  # prefill, chunk by chunk
            parts = [(i, *_chunks(SEQS[i][0])[c]) for i in joining if c < len(_chunks(SEQS[i][0]))]
            for size in sorted({len(chunk) for _, _, chunk in parts}):
                rows = [(i, start, chunk) for i, start, chunk in parts if len(chunk) == size]
                out = model(torch.tensor([chunk for _, _, chunk in rows]), [start for _, start, _ in rows],
                            slots=[slot_of[i] for i, _, _ in rows])
                widest = max(widest, len(rows))
                for (i, _, _), h in zip(rows, out):
                    hidden[i].append(h)
        for i in joining:
            tokens[i].append(int(model.lm_head.greedy(hidden[i][-1][-1])))
        running += joining
        decoding = [i for i in running if len(tokens[i]) < SEQS[i][1]]
        if decoding:
            out = model(torch.tensor([[tokens[i][-1]] for i in decoding]),
                        [len(SEQS[i][0]) + len(tokens[i]) - 1 for i in decoding], slots=[slot_of[i] for i in decoding])
            widest = max(widest, len(decoding))
            for i, h in zip(decoding, out):
                hidden[i].append(h)
                tokens[i].append(int(model.lm_head.greedy(h[-1])))
        for i in [i for i in running if len(tokens[i]) == SEQS[i][1]]:
            running.remove(i)
            _poison(model, slot_of[i])
            free.append(slot_of[i])
        step += 1
    return tokens, hidden, slot_of, widest


def _compare(folder: str, plan: ParallelPlan, rank: int = 0) -> dict:
    """Tokens and hidden states of the interleaved run against each sequence alone (a fresh copy of
    the model each); what differs, as text."""
    torch.set_num_threads(1)
    fresh = _model(folder, plan, rank)
    with row_blocked():
        tokens, hidden, slots, widest = _interleaved(copy.deepcopy(fresh))
        alone = [_alone(copy.deepcopy(fresh), prompt, new) for prompt, new, _ in SEQS]
    problems = []
    for i, (ref_tokens, ref_hidden) in enumerate(alone):
        if tokens[i] != ref_tokens:
            problems.append(f"sequence {i}: tokens {tokens[i]} != alone {ref_tokens}")
        if len(hidden[i]) != len(ref_hidden):
            problems.append(f"sequence {i}: {len(hidden[i])} calls != alone {len(ref_hidden)}")
        for call, (h, ref) in enumerate(zip(hidden[i], ref_hidden)):
            if not torch.equal(h, ref):
                problems.append(f"sequence {i} call {call}: max |Δh| {float((h - ref).abs().max()):.3g}")
    return dict(problems=problems, slots=slots, widest=widest, tokens=tokens, supports=fresh.supports_slots)


def _check(result: dict, label: str) -> None:
    assert result["supports"], f"{label}: supports_slots is False"
    assert not result["problems"], f"{label}: " + "; ".join(result["problems"][:5])
    assert result["slots"] == [2, 0, 1, 0], f"{label}: slots {result['slots']} (the fourth must reuse the second's)"
    assert result["widest"] == 3, f"{label}: at most {result['widest']} rows in one call"
    assert len({tuple(t) for t in result["tokens"]}) == len(SEQS), f"{label}: sequences decoded alike {result['tokens']}"


@pytest.mark.parametrize("key", list(ARCHS))
def test_interleaved_decode_is_exact_tp1(tmp_path, key):
    _check(_compare(_folder(tmp_path, key), ParallelPlan()), key)


def _rank(rank: int, world_size: int, folder: str) -> dict:
    return _compare(folder, ParallelPlan(tp=world_size, ep=world_size), rank)


def test_interleaved_decode_is_exact_tp2_expert_parallel(tmp_path):
    results = launch_local(_rank, 2, args=(_folder(tmp_path, "qwen3-30b-a3b"),), timeout_s=60, run_timeout_s=120)
    for rank, result in enumerate(results):
        _check(result, f"tp2 ep2 rank {rank}")
    assert results[0]["tokens"] == results[1]["tokens"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _model(_folder(tmp_path_factory.mktemp("errors"), "llama-3.1-8b"), ParallelPlan())


@pytest.mark.parametrize("ids, start, slots, message", [
    ([[1], [2]], 0, [0], "2 rows need one slot and one start each: got 1 slots and 2 starts"),
    ([[1], [2]], [0, 1, 2], [0, 1], "2 rows need one slot and one start each: got 2 slots and 3 starts"),
    ([[1], [2]], [3, 4], [1, 1], "slot 1 appears more than once in slots"),
    ([[1]], 0, [3], r"slot 3 is out of range: the model holds cache slots 0..2"),
    ([[1]], 0, [-1], r"slot -1 is out of range"),
    ([[1, 2], [3, 4]], [4, 23], [0, 2], r"row 1 \(slot 2\) covers positions 23..24, outside the KV cache's 0..23"),
    ([[1]], [-1], [0], r"row 0 \(slot 0\) covers positions -1..-1"),
    ([[1], [2]], [0, 1], None, "a start per row needs slots"),
])
def test_bad_slots_are_refused(llama, ids, start, slots, message):
    with pytest.raises(ShardwiseError, match=message):
        llama(torch.tensor(ids), start, slots)


@torch.no_grad()
def test_slots_match_the_one_sequence_path_and_report_their_limits(llama):
    assert llama.supports_slots and llama.max_batch == MAX_BATCH
    prompt = torch.tensor([_IDS[:6]])
    with row_blocked():
        plain = copy.deepcopy(llama)
        one = [plain(prompt, 0), plain(prompt[:, :1], 6)]
        slotted = copy.deepcopy(llama)
        two = [slotted(prompt, 0, [0]), slotted(prompt[:, :1], [6], [0])]
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("key", ["kimi-linear-48b-a3b", "qwen3.5-397b-a17b"])
@torch.no_grad()
def test_linear_state_rolls_back_per_slot(tmp_path, key):
    """Built for verify passes of 3 positions, each slot keeps its own snapshots: two sequences in
    slots 1 and 0 run passes of 3 in one call, each is rolled back by its own amount and passes
    again (restarts inside the last pass), bit-identical to each alone; then a restart one slot
    no longer holds is refused while the other slot carries on."""
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    folder = _folder(tmp_path, key)
    fresh = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, torch.float32, max_seq_len=MAX_SEQ_LEN,
                            max_batch=MAX_BATCH, max_step_tokens=3)
    load_shard(fresh, folder)
    assert fresh.supports_slots
    torch.set_num_threads(1)
    seqs = {1: _IDS[:6], 0: _IDS[6:10]}  # slot → prompt
    passes = {1: [(6, _IDS[10:13]), (7, _IDS[13:16]), (10, _IDS[16:17])],  # restart 2 back, then decode
              0: [(4, _IDS[17:20]), (6, _IDS[20:23]), (9, _IDS[23:24])]}  # restart 1 back
    with row_blocked():
        model = copy.deepcopy(fresh)
        got = {s: [model(torch.tensor([p]), 0, [s])[0]] for s, p in seqs.items()}
        for c in range(3):
            out = model(torch.tensor([passes[s][c][1] for s in seqs]), [passes[s][c][0] for s in seqs], list(seqs))
            for s, h in zip(seqs, out):
                got[s].append(h)
        for s, prompt in seqs.items():
            alone = copy.deepcopy(fresh)
            want = [alone(torch.tensor([prompt]), 0)[0]] + [alone(torch.tensor([ids]), p)[0] for p, ids in passes[s]]
            assert all(torch.equal(a, b) for a, b in zip(got[s], want)), f"slot {s} differs from its sequence alone"
        with pytest.raises(ShardwiseError, match=r"state at position 6 is no longer held \(held: 7..10, 4 snapshots\)"):
            model(torch.tensor([[1]]), [6], [0])
        model(torch.tensor([[1]]), [8], [1])  # slot 1 holds 8..11: its own snapshots
