"""`shardwise run --trace`: per-layer, per-rank Chrome trace and summary, from real gloo runs."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan
from shardwise.runtime import layers as layers_mod
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.generate import generate
from shardwise.runtime.launch import launch_local
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.runner import slow_rank_hook
from shardwise.runtime.trace import Tracer, clock_offset, summarize

STEPS = 6  # max new tokens: 1 prefill + 5 decode steps
SLOW_S = 0.03  # the testing hook's sleep per layer on the slowed rank: large against scheduling noise


def _run(folder: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli("run", str(folder), "--tp", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", str(STEPS),
                   "--trace", str(out), *extra, env=env)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_checkpoint("llama-3.1-8b", "tiny", tmp_path_factory.mktemp("llama"), seed=5)


@pytest.fixture(scope="module")
def traced(llama, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trace") / "run.json"
    proc = _run(llama, out, "--json")
    assert proc.returncode == 0, proc.stderr
    return {
        "doc": json.loads(proc.stdout),
        "trace": json.loads(out.read_text()),
        "summary": json.loads(out.with_suffix(".summary.json").read_text()),
    }


def test_chrome_trace_covers_every_layer_step_and_rank(traced):
    events = traced["trace"]["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in events)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    steps = {(e["pid"], e["args"]["step"]): e for e in xs if e["cat"] == "step"}
    decode = {k: e for k, e in steps.items() if e["args"]["kind"] == "decode"}
    assert len(decode) == 2 * (STEPS - 1)
    seen = defaultdict(set)
    for e in xs:
        if "layer" in e["args"]:
            assert e["args"]["kind"] == "gqa" and e["args"]["block"] in ("attn", "mlp")
            seen[(e["pid"], e["args"]["step"], e["args"]["layer"], e["args"]["block"])].add(e["cat"])
    for rank, step in decode:
        for layer in range(2):
            for block in ("attn", "mlp"):
                assert seen[(rank, step, layer, block)] == {"compute", "wait", "comm", "sync"}
    # the segments of a step tile it: their durations add up to the step's
    for (rank, step), e in steps.items():
        parts = [x for x in xs if x["pid"] == rank and x["cat"] != "step" and x["args"]["step"] == step]
        assert sum(x["dur"] for x in parts) == pytest.approx(e["dur"], abs=1 + 0.001 * e["dur"])
    # and the traced decode steps account for the run's decode time (rank 0's, measured separately); a
    # rank that entered its decode loop earlier spent the difference waiting inside its first step
    for rank in (0, 1):
        mine = sorted((step, e["dur"] / 1e6) for (r, step), e in decode.items() if r == rank)
        traced_s = sum(d for _, d in mine)
        skew = 0.0 if rank == 0 else mine[0][1]
        assert 0.8 * traced["doc"]["decode_s"] <= traced_s <= traced["doc"]["decode_s"] * 1.01 + 1e-3 + skew
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    # waiting is waiting for the last rank to arrive: at every collective both ranks' wait spans end
    # together, at the last arrival; the rank that arrived last did not wait, the other did
    waits = defaultdict(dict)
    for e in xs:
        if e["cat"] == "wait":
            waits[(e["args"]["step"], e["args"]["layer"], e["args"]["block"])][e["pid"]] = e
    assert len(waits) == STEPS * 2 * 2  # every step, layer and block
    for key, by_rank in waits.items():
        assert sorted(by_rank) == [0, 1], key
        ends = [e["ts"] + e["dur"] for e in by_rank.values()]
        assert max(ends) - min(ends) < 0.01, (key, ends)  # µs; stamps are rounded to the ns
        (last,) = {e["args"]["last_arrival_rank"] for e in by_rank.values()}
        assert by_rank[last]["dur"] == 0 and by_rank[1 - last]["dur"] > 0, (key, by_rank)


def test_summary_schema(traced):
    s, doc = traced["summary"], traced["doc"]
    assert s["kind"] == "trace" and s["model"] == doc["model"] and (s["tp"], s["ep"]) == (2, 1)
    assert s["measured_tok_per_s"] == doc["tok_per_s"] > 0
    assert s["decode_steps"] == STEPS - 1
    assert {(x["layer"], x["rank"]) for x in s["layers"]} == {(i, r) for i in range(2) for r in range(2)}
    # the summary's waits are the trace's: per decode step, the sum of that rank's wait spans at that layer
    decode = {(e["pid"], e["args"]["step"]) for e in traced["trace"]["traceEvents"]
              if e["ph"] == "X" and e["cat"] == "step" and e["args"]["kind"] == "decode"}
    traced_wait_s = defaultdict(float)
    for e in traced["trace"]["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "wait" and (e["pid"], e["args"]["step"]) in decode:
            traced_wait_s[(e["args"]["layer"], e["pid"])] += e["dur"] / 1e6 / (STEPS - 1)
    for x in s["layers"]:
        assert x["kind"] == "gqa" and x["mlp"] == "dense"
        assert x["compute_s"] > 0 and x["comm_s"] > 0 and x["sync_s"] > 0  # the arrival exchange takes time
        assert x["wait_s"] == pytest.approx(traced_wait_s[(x["layer"], x["rank"])], abs=1e-8)
    for layer in range(2):
        rows = [x for x in s["layers"] if x["layer"] == layer]
        # at every collective one rank arrives last and the other waits for it
        assert sum(x["last_arrival_share"] for x in rows) == pytest.approx(1.0)
        assert sum(x["wait_s"] for x in rows) > 0
    for r in s["ranks"]:
        parts = r["compute_s"] + r["comm_s"] + r["wait_s"] + r["sync_s"] + r["other_s"]
        # other: embedding, final norm, LM head and sampling, which take time
        assert parts == pytest.approx(r["step_s"], rel=1e-6) and r["other_s"] > 0
    assert s["slowest_rank"] in (0, 1)
    assert doc["trace"]["summary"] == s
    assert all(c["method"] == "same-host" and c["offset_ns"] == 0 for c in s["clock"])


def test_slowed_rank_makes_the_other_wait_and_is_named(llama, traced, tmp_path):
    out = tmp_path / "slow.json"
    proc = _run(llama, out, env={"SHARDWISE_TEST_SLOW_RANK": f"1:{SLOW_S}"})
    assert proc.returncode == 0, proc.stderr
    assert "slowest rank: 1 " in " ".join(proc.stdout.split())
    slow = json.loads(out.with_suffix(".summary.json").read_text())
    base = {r["rank"]: r for r in traced["summary"]["ranks"]}
    ranks = {r["rank"]: r for r in slow["ranks"]}
    assert slow["slowest_rank"] == 1
    # rank 0 now waits for most of rank 1's extra 2 x 30 ms per step, rank 1 hardly waits
    assert ranks[0]["wait_s"] > base[0]["wait_s"] + 1.5 * SLOW_S
    assert ranks[0]["wait_s"] > ranks[1]["wait_s"] + 1.5 * SLOW_S
    assert ranks[1]["compute_s"] >= 2 * SLOW_S
    for x in slow["layers"]:
        if x["rank"] == 0:
            assert x["wait_s"] > 0.7 * SLOW_S
        else:
            assert x["last_arrival_share"] >= 0.5


def _offsets(rank: int, world_size: int) -> tuple:
    torch.set_num_threads(1)
    return clock_offset(), clock_offset(force_ping_pong=True)


def test_clock_offsets_same_host_and_ping_pong():
    for same, pingpong in launch_local(_offsets, 2, run_timeout_s=120):
        assert same == (0, "same-host")
        offset, method = pingpong
        assert method == "ping-pong" and abs(offset) < 5_000_000  # one clock: only the ping-pong error


def test_tracing_off_keeps_the_plain_hook_and_tp1_trace(llama):
    model = ShardedCausalLM(load_spec(llama), ParallelPlan(), 0, torch.float32, max_seq_len=16)
    load_shard(model, llama)
    for layer in model.model.layers:
        assert layer.reduce_attn is layers_mod.allreduce and layer.reduce_mlp is layers_mod.allreduce
    plain = generate(model, [1, 2, 3], 4)
    tracer = Tracer(model).attach()
    traced = generate(model, [1, 2, 3], 4, tracer=tracer)
    tracer.detach()
    assert traced.tokens == plain.tokens
    assert all(layer.reduce_attn is layers_mod.allreduce for layer in model.model.layers)
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)
    data = tracer.export()
    assert len(data["steps"]) == 4 and len(data["rows"]) == 4 * 2 * 2
    s = summarize([data], "tiny", 1, 1, traced.decode_tok_per_s)
    assert all(x["comm_s"] == 0 and x["wait_s"] == 0 and x["compute_s"] > 0 for x in s["layers"])


def test_bad_trace_input(llama, tmp_path, monkeypatch):
    proc = _run(llama, tmp_path / "missing" / "t.json")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: --trace {tmp_path / 'missing' / 't.json'}: folder '{tmp_path / 'missing'}' does not exist"
    proc = _run(llama, tmp_path / "t.json", "--timeout", "0")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --timeout must be > 0 seconds, got 0"
    monkeypatch.setenv("SHARDWISE_TEST_SLOW_RANK", "one:fast")
    with pytest.raises(ShardwiseError, match="must look like RANK:SECONDS"):
        slow_rank_hook(0)
    monkeypatch.setenv("SHARDWISE_TEST_SLOW_RANK", "1:0.5")
    assert slow_rank_hook(0) == 0.0 and slow_rank_hook(1) == 0.5
