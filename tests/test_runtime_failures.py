"""SIGKILL one rank of a real `shardwise run` mid-generation (tp=2 and tp=3, gloo on loopback).

Every other rank must exit non-zero with a message naming the lost rank, the command must
exit non-zero with a one-line error naming it, nothing may be left running, and all of it
within 60 s of the kill.
"""

from __future__ import annotations

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

from conftest import cli_argv, cli_env
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


def _ranks_of(pid: int) -> dict[int, int]:
    """{rank: pid} of the live rank processes launched by ``pid`` (named ``shardwise-rR``)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(")")[-1].split()
            comm = (stat.parent / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and comm.startswith("shardwise-r"):
            found[int(comm[len("shardwise-r"):])] = int(stat.parent.name)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize(("tp", "victim"), [(2, 1), (3, 0)], ids=["tp2-kill-rank1", "tp3-kill-rank0"])
def test_sigkill_one_rank_mid_generation(llama6, tp, victim):
    # rank 0 sleeps 1 ms per layer (testing hook) so 20000 tokens take far longer than the test
    proc = subprocess.Popen(
        cli_argv("run", str(llama6), "--tp", str(tp), "--prompt-ids", "1,2,3", "--max-new-tokens", "20000"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env({"SHARDWISE_TEST_SLOW_RANK": "0:0.001"}),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr))
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("generating up to 20000 tokens" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "generation did not start within 120 s"
            time.sleep(0.1)
        time.sleep(1.0)  # well into decoding
        ranks = _ranks_of(proc.pid)
        assert sorted(ranks) == list(range(tp)), ranks
        os.kill(ranks[victim], signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=LIMIT_S)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join()
    stderr = "".join(lines)
    assert took < LIMIT_S, f"took {took:.1f} s"
    assert proc.returncode == 2, stderr  # the lost rank is a ShardwiseError (RankFailure): exit 2
    last = stderr.strip().splitlines()[-1]
    lost = f"rank {victim} of {tp} failed: killed by SIGKILL (exit code -9)"
    assert last.startswith(f"error: {lost}"), stderr
    for r in set(range(tp)) - {victim}:
        assert f"[shardwise rank {r}] stopping: {lost}" in stderr, stderr
        assert f"then rank {r}: stopped after rank {victim} of {tp} failed (exit code 1)" in last, last
    assert "Traceback" not in stderr, stderr  # the survivors' knock-on errors stay one line
    assert not any(_alive(pid) for pid in ranks.values())
