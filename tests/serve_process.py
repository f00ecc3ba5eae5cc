"""A `shardwise serve` process for tests: started as a user starts it, on a free loopback port.

    with ServeProcess("--tp", "2") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")

``stop(sig)`` sends a signal to the launcher and returns its exit code; leaving the block kills
whatever is left (the whole process group) and fails the test if anything had to be killed
that should have exited on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from pathlib import Path

import pytest

from conftest import cli_argv, cli_env, free_port, launched_ranks, plan_json

READY_S = 120.0  # a cold start imports torch and transformers and loads the shards


def http(url: str, body: bytes | dict | list | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    """(status, body bytes) of a GET, or a POST of ``body`` (anything but bytes is sent as JSON)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read()
        except HTTPException:  # the server went away mid-body (a fault test kills it): the status stands
            return exc.code, b""


def assert_point_measured(point: dict) -> None:
    """One `bench --url` point (plan flags given): positive rates, sane latencies, the plan's batch-1
    TP1 prediction beside it and its error where a batch-1 figure is comparable (concurrency 1)."""
    assert point["decode_tok_per_s"] > 0 and point["prefill_tok_per_s"] > 0 and point["decode_total_tok_per_s"] > 0
    assert 0 < point["ttft_s"]["p50"] <= point["ttft_s"]["p99"] < 60
    assert 0 < point["itl_s"]["p50"] <= point["itl_s"]["p99"] < 60
    pred = point["prediction"]
    assert pred["batch"] == 1 and pred["layout"] == "TP1" and pred["decode_tok_per_s"] > 0
    assert (point["decode_error"] is not None) == (point["concurrency"] == 1)


def assert_prediction_is_the_plans(doc: dict) -> None:
    """The pp32 @ d32 point's prediction is `plan`'s own figure for that context and prompt (llama-3.1-8b
    on one DGX Spark)."""
    plan = plan_json("--model", "llama-3.1-8b", "--box", "dgx-spark", "--boxes", "1", "--context", str(32 + 32 + 4),
                     "--prompt-tokens", str(32 + 32))
    deep = doc["points"][2]["prediction"]
    assert deep["decode_tok_per_s"] == pytest.approx(plan["decode"]["tok_per_s"])
    assert deep["prefill_tok_per_s"] == pytest.approx(plan["prefill"]["tok_per_s"])


@contextlib.contextmanager
def third_party_server(name: str, argv: list[str], port: int, log: Path, env: dict[str, str], start_s: float):
    """Another OpenAI-compatible server (``argv`` listening on 127.0.0.1:``port``, output to ``log``):
    yields its base URL once ``/v1/models`` answers 200; always stopped (SIGTERM, then SIGKILL)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if http(url + "/models", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} did not start in {start_s} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


class ServeProcess:
    """``shardwise serve ARGS --port P`` in its own session; stdout/stderr to files under ``log_dir``."""

    def __init__(self, *args: str, log_dir: Path | None = None, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.log_dir = Path(log_dir or os.environ.get("TMPDIR", "/tmp"))
        self.out = open(self.log_dir / f"serve-{self.port}.out", "w+")
        self.err = open(self.log_dir / f"serve-{self.port}.err", "w+")
        self.proc = subprocess.Popen(cli_argv("serve", *args, "--port", str(self.port)), stdout=self.out,
                                     stderr=self.err, env=cli_env(env), start_new_session=True)

    def __enter__(self) -> ServeProcess:
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def wait_ready(self, timeout: float = READY_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.stderr()}")
            try:
                if http(self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve not ready in {timeout} s: {self.stderr()}")

    def stderr(self) -> str:
        self.err.flush()
        return Path(self.err.name).read_text()

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one series of ``/metrics`` (0 when absent)."""
        text = http(self.url + "/metrics")[1].decode()
        match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def rank_pid(self, rank: int) -> int:
        """PID of the rank process (the launcher names them ``shardwise-rR``)."""
        pid = launched_ranks(self.proc.pid).get(rank)
        if pid is None:
            raise AssertionError(f"no rank {rank} process under {self.proc.pid}")
        return pid

    def rss_bytes(self, pid: int) -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for {pid}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40.0) -> int:
        """Signal the launcher; its exit code (the test fails if it does not exit in ``timeout`` s)."""
        self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"serve did not exit within {timeout} s: {self.stderr()}") from None

    def leftovers(self, grace: float = 5.0) -> list[int]:
        """PIDs still alive in the server's process group ``grace`` s after the launcher exited (helpers
        such as multiprocessing's resource tracker exit when they notice their parent is gone)."""
        deadline = time.monotonic() + grace
        while (alive := self._group()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive

    def _group(self) -> list[int]:
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # pgid == the launcher's pid
                    out.append(int(entry.name))
        return out

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.out.close()
        self.err.close()
