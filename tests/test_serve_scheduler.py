"""The server's scheduler alone (no model): slots, chunked prefill interleaved with decode steps,
admission and release, speculation only for a sequence alone, stop strings and EOS."""

from __future__ import annotations

import torch

from shardwise.runtime.checkpoint import default_checkpoint
from shardwise.runtime.drafters import PromptLookup
from shardwise.serve.protocol import GenRequest
from shardwise.serve.scheduler import Scheduler, Seq
from shardwise.serve.text import ServeTokenizer, TextStream

TOK = ServeTokenizer(default_checkpoint())
EOS = 1


def _seq(prompt, max_tokens=5, events=None, stop=(), temperature=0.0):
    req = GenRequest("text", list(prompt), max_tokens, temperature=temperature, stop=list(stop), seed=3)
    out = events if events is not None else []
    return Seq(req, TextStream(TOK, list(stop)), out.append)


def _run(sched, plan, picks):
    """Apply ``picks`` (token per picked row) as the model's greedy choice."""
    sched.apply(plan, torch.tensor(picks), None)


def test_long_prompt_is_read_in_chunks_between_decode_steps():
    sched = Scheduler(slots=2, prefill_chunk=4, eos={EOS})
    a, b = _seq([5, 6], max_tokens=50), _seq(list(range(10, 20)), max_tokens=3)
    sched.add(a)
    plan = sched.next_step()
    assert plan.message["prefill"] == {"slots": [0], "starts": [0], "ids": [[5, 6]], "last": [True]}
    assert not plan.message["decode"]
    _run(sched, plan, [40])
    sched.add(b)
    starts = []
    for _ in range(3):  # b's 10 prompt tokens in chunks of 4, 4, 2; a decodes in every one of those steps
        plan = sched.next_step()
        assert plan.message["decode"]["slots"] == [0] and plan.message["decode"]["tokens"] == [a.generated[-1]]
        prefill = plan.message["prefill"]
        starts.append((prefill["starts"][0], len(prefill["ids"][0])))
        _run(sched, plan, [41] + ([42] if prefill["last"][0] else []))
    assert starts == [(0, 4), (4, 4), (8, 2)]
    assert a.generated == [40, 41, 41, 41] and b.generated == [42] and b.slot == 1
    plan = sched.next_step()  # both decode now, each at its own position
    assert plan.message["decode"] == {"slots": [0, 1], "positions": [5, 10], "tokens": [41, 42]}


def test_slots_are_held_until_finish_and_queue_waits():
    sched = Scheduler(slots=1, prefill_chunk=8, eos={EOS})
    events = []
    a, b = _seq([5], max_tokens=2, events=events), _seq([6], max_tokens=1)
    sched.add(a)
    sched.add(b)
    plan = sched.next_step()
    assert [s is a for s in plan.rows] == [True] and list(sched.waiting) == [b]
    _run(sched, plan, [50])
    _run(sched, sched.next_step(), [51])  # a reaches max_tokens: finished, slot 0 free again
    assert a.finish == "length" and events[-1][0] == "done" and events[-1][2]["completion_tokens"] == 2
    plan = sched.next_step()
    assert plan.message["prefill"]["slots"] == [0] and plan.rows == [b]


def test_same_length_chunks_are_read_together_within_the_chunk_budget():
    sched = Scheduler(slots=4, prefill_chunk=8, eos={EOS})
    seqs = [_seq([5, 6, 7]), _seq([8, 9, 10]), _seq([11, 12]), _seq([13, 14, 15])]
    for seq in seqs:
        sched.add(seq)
    plan = sched.next_step()  # chunks of 3 tokens: at most 8 // 3 = 2 sequences, oldest first
    assert plan.message["prefill"] == {"slots": [0, 1], "starts": [0, 0], "ids": [[5, 6, 7], [8, 9, 10]],
                                       "last": [True, True]}
    _run(sched, plan, [20, 21])
    plan = sched.next_step()  # the oldest left has 2 tokens: the 3-token one waits for its own step
    assert plan.message["prefill"]["ids"] == [[11, 12]] and plan.message["decode"]["slots"] == [0, 1]


def test_eos_stops_and_cancel_frees_the_slot_at_once():
    sched = Scheduler(slots=2, prefill_chunk=8, eos={EOS})
    a, b = _seq([5], max_tokens=9), _seq([6], max_tokens=9)
    sched.add(a)
    sched.add(b)
    _run(sched, sched.next_step(), [7, 8])  # both one-token prompts read in one forward
    _run(sched, sched.next_step(), [EOS, 8])  # a stops on EOS
    assert a.finish == "stop" and a.slot is None and sched.slots_in_use == 1
    sched.cancel(b)
    assert sched.slots_in_use == 0 and not sched.has_work()


def test_speculation_only_when_alone_and_only_accepted_drafts_count():
    sched = Scheduler(slots=2, prefill_chunk=64, eos={EOS}, spec_tokens=3, drafter=lambda: PromptLookup(1, 3),
                      max_model_len=256)
    a = _seq([9, 10, 11, 9, 10, 11, 9, 10], max_tokens=20)
    sched.add(a)
    _run(sched, sched.next_step(), [11])
    plan = sched.next_step()  # context ends 9 10 11: lookup proposes 9 10 11
    assert plan.message["decode"]["drafts"] == [9, 10, 11] and plan.message["greedy"] == [0, 1, 2, 3]
    _run(sched, plan, [9, 10, 12, 77])  # agrees on two drafts, then says 12: keep 9 10 12
    assert a.generated == [11, 9, 10, 12]
    sched.add(_seq([3, 4], max_tokens=4))
    plan = sched.next_step()  # company: no drafts
    assert "drafts" not in plan.message["decode"]


def test_stop_string_ends_generation_without_emitting_it():
    events = []
    ids = TOK.encode("hello world, hello cluster")
    seq = _seq([5], max_tokens=50, events=events, stop=["cluster"])
    sched = Scheduler(slots=1, prefill_chunk=8, eos={EOS})
    sched.add(seq)
    for token in ids:
        plan = sched.next_step()
        if plan is None:
            break
        _run(sched, plan, [token])
    text = "".join(e[1] for e in events if e[0] == "delta")
    assert seq.finish == "stop" and text == "hello world, hello " and events[-1][1] == "stop"


def test_seeded_sampling_draws_the_same_tokens():
    logits = torch.randn(3, 64)
    draws = []
    for _ in range(2):
        sched = Scheduler(slots=1, prefill_chunk=8, eos=set())
        seq = _seq([5], max_tokens=3, temperature=0.8)
        sched.add(seq)
        for row in logits:
            plan = sched.next_step()
            assert plan.message["sample"] == [0] and plan.message["greedy"] == []
            sched.apply(plan, None, row[None])
        draws.append(seq.generated)
    assert draws[0] == draws[1] and len(draws[0]) == 3
