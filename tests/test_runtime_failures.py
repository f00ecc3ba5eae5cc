"""Faults in a real `shardwise run` mid-generation (gloo on loopback): SIGKILL one rank (tp=2 and
tp=3), SIGSTOP one rank (default settings), SIGINT to the leader.

A killed or frozen rank: every other rank must exit non-zero with a message naming it, the command
must exit non-zero with a one-line error naming it, nothing may be left running, and all of it within
60 s of the signal. Ctrl-C on the leader: exit 130 with one line, no rank left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import alive, cli_argv, cli_env, launched_ranks
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.spec.model import NORM
from shardwise.spec.parse import parse_config

LIMIT_S = 60.0


@pytest.fixture(scope="module")
def llama6(tmp_path_factory) -> Path:
    """A tiny llama with 6 heads (MHA) and vocab 516, so tp=2 and tp=3 both split it."""
    base = make_checkpoint("llama-3.1-8b", "tiny", tmp_path_factory.mktemp("base"), seed=3)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(hidden_size=96, num_attention_heads=6, num_key_value_heads=6, head_dim=16,
               intermediate_size=192, vocab_size=516)
    spec = parse_config(cfg, name="tiny-llama6")
    gen = torch.Generator().manual_seed(3)
    tensors = {
        t.name: torch.ones(t.shape) if t.group == NORM else torch.randn(t.shape, generator=gen) * 0.02
        for t in spec.tensors()
    }
    out = tmp_path_factory.mktemp("llama6")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _long_run(llama6: Path, tp: int, tokens: int = 20000, session: bool = False):
    """A `shardwise run` decoding far longer than any test (rank 0 sleeps 1 ms per layer, a testing
    hook), returned once generation is under way: (process, its stderr lines so far — a thread keeps
    reading them —, that thread, {rank: pid}). With ``session`` it leads a process group of its own,
    which a terminal's Ctrl-C signals as a whole."""
    proc = subprocess.Popen(
        cli_argv("run", str(llama6), "--tp", str(tp), "--prompt-ids", "1,2,3", "--max-new-tokens", str(tokens)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env({"SHARDWISE_TEST_SLOW_RANK": "0:0.001"}),
        start_new_session=session,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr))
    reader.start()
    deadline = time.monotonic() + 120
    while not any(f"generating up to {tokens} tokens" in line for line in lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            _end(proc, {}, reader)
            pytest.fail(f"generation did not start within 120 s: {''.join(lines)}")
        time.sleep(0.1)
    time.sleep(1.0)  # well into decoding
    ranks = launched_ranks(proc.pid)
    if sorted(ranks) != list(range(tp)):
        _end(proc, ranks, reader)  # not left running (decoding 20000 tokens) after the test
        pytest.fail(f"expected ranks 0..{tp - 1} under the launcher, found {ranks}")
    return proc, lines, reader, ranks


def _end(proc: subprocess.Popen, ranks: dict[int, int], reader: threading.Thread) -> None:
    """Whatever a failed test left: the command and its ranks killed (a stopped rank continued first)."""
    for pid in ranks.values():
        with contextlib.suppress(ProcessLookupError):  # it may exit between the look and the kill
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    reader.join()


def _signal_one_rank(llama6: Path, tp: int, victim: int, sig: int) -> tuple[float, int, str, dict[int, int]]:
    """``sig`` to rank ``victim`` of a long `shardwise run` at ``tp``: (seconds until the command exited,
    its exit code, its stderr, {rank: pid}); whatever is left is killed afterwards."""
    proc, lines, reader, ranks = _long_run(llama6, tp)
    try:
        os.kill(ranks[victim], sig)
        sent = time.monotonic()
        proc.wait(timeout=LIMIT_S)
        took = time.monotonic() - sent
    finally:
        _end(proc, ranks, reader)
    return took, proc.returncode, "".join(lines), ranks


@pytest.mark.parametrize(("tp", "victim"), [(2, 1), (3, 0)], ids=["tp2-kill-rank1", "tp3-kill-rank0"])
def test_sigkill_one_rank_mid_generation(llama6, tp, victim):
    took, code, stderr, ranks = _signal_one_rank(llama6, tp, victim, signal.SIGKILL)
    assert took < LIMIT_S, f"took {took:.1f} s"
    assert code == 2, stderr  # the lost rank is a ShardwiseError (RankFailure): exit 2
    last = stderr.strip().splitlines()[-1]
    lost = f"rank {victim} of {tp} failed: killed by SIGKILL (exit code -9)"
    assert last.startswith(f"error: {lost}"), stderr
    for r in set(range(tp)) - {victim}:
        assert f"[shardwise rank {r}] stopping: {lost}" in stderr, stderr
        assert f"then rank {r}: stopped after rank {victim} of {tp} failed (exit code 1)" in last, last
    assert "Traceback" not in stderr, stderr  # the survivors' knock-on errors stay one line
    assert not any(alive(pid) for pid in ranks.values())


def test_sigstop_one_rank_is_named_within_60_s(llama6):
    """Default settings (no --timeout): the launcher's heartbeats name the frozen rank (after 10 s)."""
    took, code, stderr, ranks = _signal_one_rank(llama6, 2, 1, signal.SIGSTOP)
    assert took < LIMIT_S, f"took {took:.1f} s"
    assert code == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 of 2 failed: stopped making progress: no heartbeat for"), stderr
    assert "then rank 0: stopped after rank 1 of 2 failed" in last, last
    assert "[shardwise rank 0] stopping: rank 1 of 2 failed: stopped making progress" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert not any(alive(pid) for pid in ranks.values())


@pytest.mark.parametrize("to", ["leader", "group"])
def test_sigint_exits_130_and_leaves_no_rank(llama6, to):
    """SIGINT to the launcher alone, or to its whole process group (a terminal's Ctrl-C)."""
    proc, lines, reader, ranks = _long_run(llama6, 2, session=to == "group")
    try:
        if to == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=LIMIT_S)
    finally:
        _end(proc, ranks, reader)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in stderr, stderr
    assert not any(alive(pid) for pid in ranks.values())
