"""Helpers shared by the tests: the ``shardwise`` command run as a user runs it.

Tests import them by name (pytest puts this folder on ``sys.path``)::

    from conftest import cli_json, run_cli
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
CLI_TIMEOUT_S = 300  # the longest any test allowed one command (validate, report, sweep)


def cli_argv(*args: str) -> list[str]:
    """The command line of ``shardwise ARGS`` (for a test that needs ``Popen``)."""
    return [sys.executable, "-m", "shardwise", *args]


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a CLI test runs in: the inherited one, this checkout's ``src`` first on the
    path, ``COLUMNS`` fixed wide so that rich's tables come out the same whatever terminal runs the
    tests (captured output is not a terminal; rich would use the caller's COLUMNS or 80), then ``env``."""
    return {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "250", **(env or {})}


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python -m shardwise ARGS`` in a subprocess (``cli_env(env)``); stdout and stderr captured as text."""
    return subprocess.run(cli_argv(*args), capture_output=True, text=True, timeout=timeout, env=cli_env(env))


def cli_in_process(*args: str) -> tuple[int, str, str]:
    """``shardwise ARGS`` run in this process through ``cli.main``, as the console script runs it:
    (exit code, stdout, stderr). No interpreter start, so hundreds of calls stay fast; for commands
    that start no processes. An exception ``main`` lets through (a bug) propagates to the test."""
    from shardwise import cli

    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, ["shardwise", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def int_llamas(root: Path, seed: int) -> dict[str, Path]:
    """A tiny llama with rows 256 wide (whole 128-weight lines for the int kernels) and its int4 / int8 quantizations
    (LM heads too) under ``root``: {"float", "int4", "int8"} folders."""
    from shardwise.runtime.checkpoint import make_checkpoint
    from shardwise.runtime.quantize_checkpoint import quantize_checkpoint

    wide = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64}
    folders = {"float": make_checkpoint("llama-3.1-8b", "tiny", root / "f", seed=seed, overrides=wide)}
    for fmt in ("int4", "int8"):
        quantize_checkpoint(folders["float"], root / fmt, fmt, compare=False, lm_head=True)
        folders[fmt] = root / fmt
    return folders


def free_port() -> int:
    """A loopback port nothing listens on, outside the host's ephemeral range (the launcher's own
    choice, ``rendezvous.free_port``: a port from ``bind(0)`` was taken by another process between the
    check and the server's bind in CI)."""
    from shardwise.runtime.rendezvous import free_port as launcher_port

    return launcher_port("127.0.0.1")


def cpu_has(flag: str) -> bool:
    """Whether this CPU lists ``flag`` (e.g. ``avx512_bf16``) in /proc/cpuinfo (False where there is none)."""
    return os.path.exists("/proc/cpuinfo") and flag in open("/proc/cpuinfo").read().split()


def live_processes() -> dict[int, tuple[int, str, bytes]]:
    """{pid: (parent pid, comm, cmdline)} of every process that is running (zombies aside)."""
    procs = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = (stat.parent / "comm").read_text().strip()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z":
            procs[int(stat.parent.name)] = (int(fields[1]), comm, cmdline)
    return procs


def forkservers(launcher: int, procs: dict[int, tuple[int, str, bytes]]) -> set[int]:
    """The pids among ``procs`` (``live_processes()``) of ``launcher``'s forkserver, which forks its ranks
    (``runtime.rank_start``)."""
    return {pid for pid, (ppid, _, cmd) in procs.items() if ppid == launcher and b"forkserver" in cmd}


def launched_ranks(launcher: int) -> dict[int, int]:
    """{rank: pid} of the live rank processes ``launcher`` started (named ``shardwise-rR``): those its forkserver
    forked, or its own children."""
    procs = live_processes()
    parents = {launcher} | forkservers(launcher, procs)
    return {int(comm[len("shardwise-r"):]): pid for pid, (ppid, comm, _) in procs.items()
            if ppid in parents and comm.startswith("shardwise-r")}


def alive(pid: int) -> bool:
    """Is process ``pid`` running (not gone, not a zombie)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def cli_json(*args: str, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S) -> dict:
    """``shardwise ARGS --json``, which must exit 0; its stdout parsed."""
    proc = run_cli(*args, "--json", env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def plan_json(*args: str) -> dict:
    """``shardwise plan ARGS --json``, which must exit 0; its document."""
    return cli_json("plan", *args)


@pytest.fixture(scope="session")
def probe_run(tmp_path_factory, worker_id) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """``shardwise probe --ranks 2`` once for the whole run, small sizes, one thread per rank (the two
    ranks share this machine's cores): (the finished command, its cluster TOML, its JSON document).
    tests/test_probe.py checks what it measured; tests/test_bench.py benches against it. Under
    pytest-xdist the workers share one probe (the first to need it runs it under a file lock, as
    xdist's docs show for session data), not one each."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent
    folder, record = root / "shared-probe", root / "shared-probe" / "command.json"
    out, doc = folder / "cluster.toml", folder / "probe.json"
    with FileLock(str(root / "shared-probe.lock")):
        if not record.exists():
            folder.mkdir(exist_ok=True)
            done = run_cli("probe", "--ranks", "2", "--max-bytes", "16777216", "--iters", "9", "--algorithms",
                           "ring,rd,oneshot", "--triad-mb", "8", "--matmul-size", "64", "--host-batches", "5", "--out", str(out),
                           "--json-out", str(doc), env={"OMP_NUM_THREADS": "1"})
            record.write_text(json.dumps({"args": [str(a) for a in done.args], "returncode": done.returncode,
                                          "stdout": done.stdout, "stderr": done.stderr}))
    kept = json.loads(record.read_text())
    return subprocess.CompletedProcess(kept["args"], kept["returncode"], kept["stdout"], kept["stderr"]), out, doc
