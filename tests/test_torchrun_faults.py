"""Ranks started by torchrun watch each other through the rendezvous store (runtime/peer_watch.py):
a frozen rank ends the run (`run`, and `serve` with its stream failed) within seconds, named, with no
process left; a rank that finished first is not mistaken for a frozen one. The frozen-rank threshold is shortened with the testing
hook (SHARDWISE_TEST_FROZEN_S=3); tests/test_runtime_failures.py holds the default under 60 s."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.client import HTTPException
from pathlib import Path

import pytest

from conftest import alive, cli_env, free_port
from shardwise.runtime.checkpoint import make_checkpoint

LIMIT_S = 60.0


def _torchrun(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env({"SHARDWISE_TEST_FROZEN_S": "3", **env}),
    )


def _end(proc: subprocess.Popen, ranks: dict[int, int]) -> None:
    """Whatever a failed test left: torchrun and its ranks killed (a stopped rank continued first)."""
    for pid in ranks.values():
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


def _ranks(parent: int) -> dict[int, int]:
    """{RANK: pid} of torchrun's worker processes."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().split(")")[-1].split()[1]) != parent:
                continue
            env = dict(v.split("=", 1) for v in (stat.parent / "environ").read_text().split("\0") if "=" in v)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(stat.parent.name)
    return found


def test_frozen_rank_under_torchrun_is_named_and_ends_every_process(tmp_path):
    ckpt = make_checkpoint("llama-3.1-8b", "tiny", tmp_path / "llama", seed=3)
    proc = _torchrun("-m", "shardwise", "run", str(ckpt), "--tp", "2", "--prompt-ids", "1,2,3",
                     "--max-new-tokens", "20000", env={"SHARDWISE_TEST_SLOW_RANK": "0:0.001"})
    ranks: dict[int, int] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # rank 0 says when generation starts
            if "generating up to 20000 tokens" in line:
                break
        else:
            pytest.fail("generation never started")
        time.sleep(1.0)
        ranks = _ranks(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        out = proc.communicate(timeout=LIMIT_S)[0]
        took = time.monotonic() - stopped
    finally:
        _end(proc, ranks)
    assert proc.returncode != 0, out
    assert took < 15, f"took {took:.1f} s with a 3 s threshold"
    assert "error: [shardwise rank 0] stopping: rank 1 of 2 stopped making progress: no heartbeat for" in out, out
    assert not any(alive(pid) for pid in ranks.values())  # the frozen rank too: its peer on this host killed it


def test_a_rank_that_finished_first_is_not_called_frozen(tmp_path):
    """Rank 1 leaves its watch at once, rank 0 keeps working for 1.5 times the threshold: exit 0."""
    script = tmp_path / "job.py"
    script.write_text(
        "import time, torch.distributed as dist\n"
        "from shardwise.runtime.peer_watch import watch_peers\n"
        "from shardwise.runtime.rendezvous import init_from_env\n"
        "rank, world = init_from_env('gloo', timeout_s=60)\n"
        "with watch_peers(rank, world):\n"
        "    time.sleep(4.5 if rank == 0 else 0.3)\n"
        "print(f'done {rank}', flush=True)\n"
    )
    proc = _torchrun(str(script), env={})
    out = proc.communicate(timeout=LIMIT_S)[0]
    assert proc.returncode == 0, out
    assert "done 0" in out and "done 1" in out and "stopped making progress" not in out, out


def test_frozen_rank_under_torchrun_serve_ends_the_stream_in_an_error(tmp_path):
    """`shardwise serve` under torchrun: a rank frozen mid-stream — rank 0's watcher fails the request
    (an error event on the stream), names the rank, and every process ends."""
    ckpt = make_checkpoint("llama-3.1-8b", "tiny", tmp_path / "llama", seed=3)
    port = free_port()
    proc = _torchrun("-m", "shardwise", "serve", str(ckpt), "--tp", "2", "--port", str(port), "--max-model-len", "256",
                     env={})
    base, ranks, stream = f"http://127.0.0.1:{port}", {}, []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            time.sleep(0.5)
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        body = {"model": model, "prompt": [4, 5, 6], "max_tokens": 200, "stream": True, "ignore_eos": True}
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})

        def read() -> None:
            with contextlib.suppress(OSError, HTTPException), urllib.request.urlopen(req, timeout=60) as resp:
                for line in resp:
                    stream.append(line.decode())

        reader = threading.Thread(target=read)
        reader.start()
        while not stream:
            assert time.monotonic() < deadline + 60, "no token streamed"
            time.sleep(0.05)
        ranks = _ranks(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        out = proc.communicate(timeout=LIMIT_S)[0]
        reader.join(10)
    finally:
        _end(proc, ranks)
    assert proc.returncode != 0, out
    assert "rank 1 of 2 stopped making progress" in out, out
    assert any('"error"' in line for line in stream), "".join(stream)[-2000:]
    assert not any(alive(pid) for pid in ranks.values())
