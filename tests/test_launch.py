"""launch_local / init_from_env with real processes over gloo on loopback.

Failure tests check three things: the parent raises a ShardwiseError naming the rank
that failed, no rank process is left alive, and it all happens well within 60 s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import forkservers, free_port, live_processes
from shardwise.errors import ShardwiseError
from shardwise.runtime import comm
from shardwise.runtime.launch import RankFailure, launch_local
from shardwise.runtime.rendezvous import RankContext, _ephemeral_range, init_from_env
from shardwise.runtime.rendezvous import free_port as launcher_port

SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)
LIMIT_S = 60.0  # the most any failure may take to be detected and cleaned up


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _rank_children() -> list[int]:
    """Live rank processes of this test process: its children and its forkserver's (``rank_start``), multiprocessing's
    resource tracker and the forkserver itself aside."""
    procs = live_processes()
    servers = forkservers(os.getpid(), procs)
    return [pid for pid, (ppid, _, cmd) in procs.items()
            if (ppid == os.getpid() or ppid in servers) and pid not in servers and b"resource_tracker" not in cmd]


def _pids(tmp: Path, world_size: int, timeout_s: float = LIMIT_S) -> list[int]:
    """Wait until every rank wrote ``rank{r}.ready`` and return their pids."""
    deadline = time.monotonic() + timeout_s
    files = [tmp / f"rank{r}.ready" for r in range(world_size)]
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks did not start within {timeout_s} s")
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


def _mark(tmp: str, rank: int, name: str, text: str) -> None:
    path = Path(tmp) / f"rank{rank}.{name}"
    path.with_suffix(".tmp").write_text(text)
    path.with_suffix(".tmp").rename(path)  # readers never see a half-written file


# --------------------------------------------------------------------------- workers


def _context_worker(rank: int, world_size: int) -> tuple:
    torch.set_num_threads(1)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME")}
    return RankContext.current(), t.item(), env, os.getpid()


def _failing_worker(rank: int, world_size: int, mode: str, tmp: str) -> None:
    """Every rank marks itself ready, then one rank fails in the way ``mode`` says
    while the others sit in collectives."""
    torch.set_num_threads(1)
    t = torch.ones(1 << 18)
    comm.ring_allreduce(t)  # every rank is connected and past start-up
    _mark(tmp, rank, "ready", str(os.getpid()))
    dist.barrier()  # every rank's pid is on disk before anything fails
    if rank == 1 and mode == "raise":
        _mark(tmp, rank, "failed", repr(time.time()))
        raise ValueError("boom from rank 1")
    if rank == 1 and mode == "exit":
        _mark(tmp, rank, "failed", repr(time.time()))
        os._exit(3)
    if rank == 1 and mode == "sleep":  # alive but never joins: the peers' collective times out
        time.sleep(600)
    while True:  # "kill": the test SIGKILLs rank 1 from outside while this loops
        comm.ring_allreduce(t)


def _sleeping_worker(rank: int, world_size: int, tmp: str) -> None:
    _mark(tmp, rank, "ready", str(os.getpid()))
    time.sleep(600)


# --------------------------------------------------------------------------- tests


def test_launch_returns_results_in_rank_order_with_context():
    results = launch_local(_context_worker, 2, run_timeout_s=120)
    for rank, (ctx, total, env, pid) in enumerate(results):
        assert ctx == RankContext(rank, 2, rank, "gloo", torch.device("cpu"))
        assert total == 3.0
        assert env == {"MASTER_ADDR": "127.0.0.1", "LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo"}
        assert not _alive(pid)
    assert _rank_children() == []


def _launch_time_worker(rank: int, world_size: int) -> tuple:
    for stream, name in ((sys.stdout, "out"), (sys.stderr, "err")):  # one write a line: ranks share the file
        stream.write(f"rank {rank} {name}\n")
        stream.flush()
    return os.environ.get("SHARDWISE_TEST_LAUNCH_MARK"), os.environ.get("SHARDWISE_TEST_UNSET"), torch.get_num_threads()


def test_ranks_take_the_launchers_environment_and_output_as_they_are_at_each_launch(tmp_path, monkeypatch):
    """Ranks fork from a server started by the first launch (``rank_start``): what the launcher changed since —
    its environment, OMP_NUM_THREADS, where its descriptors 1 and 2 point — is what each later launch's ranks see."""
    monkeypatch.setenv("SHARDWISE_TEST_UNSET", "before")
    launch_local(_context_worker, 2, run_timeout_s=120)  # starts the server (or it ran already)
    monkeypatch.setenv("SHARDWISE_TEST_LAUNCH_MARK", "after")
    monkeypatch.delenv("SHARDWISE_TEST_UNSET")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, err = tmp_path / "out", tmp_path / "err"
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with out.open("w") as o, err.open("w") as e:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
            results = launch_local(_launch_time_worker, 2, run_timeout_s=120)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    assert results == [("after", None, 1)] * 2
    assert sorted(out.read_text().split("\n")[:-1]) == ["rank 0 out", "rank 1 out"]
    assert {"rank 0 err", "rank 1 err"} <= set(err.read_text().splitlines())


def _send_tensor_and_exit(conn) -> None:
    from shardwise.runtime import launch

    launch._send(conn, ("ok", {"next": torch.arange(6.0).view(2, 3)}))
    conn.close()


def test_a_tensor_result_is_read_after_its_rank_exited():
    """The launcher may read a rank's result after that rank exited (a busy host): tensors must travel by
    value, not as torch shared memory fetched from the sender (lost then: "exited ... without returning")."""
    import multiprocessing

    from shardwise.runtime.launch import _Supervisor

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_send_tensor_and_exit, args=(send,))
    proc.start()
    send.close()
    proc.join(LIMIT_S)
    assert proc.exitcode == 0
    supervisor = _Supervisor([proc], [receive], [None])
    supervisor._drain(0)
    assert supervisor.returned == [True] and supervisor.reported == {}
    assert torch.equal(supervisor.results[0]["next"], torch.arange(6.0).view(2, 3))


def _expect_failure(tmp: Path, world_size: int, mode: str, **kwargs) -> tuple[RankFailure, float]:
    """Run ``_failing_worker``; return the error and the time (s) from failure to raise."""
    with pytest.raises(RankFailure) as info:
        launch_local(_failing_worker, world_size, (mode, str(tmp)), run_timeout_s=120, **kwargs)
    raised = time.time()
    for pid in _pids(tmp, world_size, timeout_s=0):
        assert not _alive(pid)
    assert _rank_children() == []
    failed_at = float((tmp / "rank1.failed").read_text()) if (tmp / "rank1.failed").exists() else None
    return info.value, (raised - failed_at if failed_at else 0.0)


def test_rank_exception_stops_all_ranks(tmp_path):
    err, detect_s = _expect_failure(tmp_path, 3, "raise")
    assert isinstance(err, ShardwiseError)
    assert str(err).startswith("rank 1 of 3 failed: ValueError: boom from rank 1 (exit code 1)")
    assert "\n" not in str(err)
    assert err.rank == 1 and all(code != 0 for code in err.exit_codes)
    assert detect_s < LIMIT_S / 2, f"took {detect_s:.1f} s"


def test_rank_exit_code_is_reported(tmp_path):
    err, detect_s = _expect_failure(tmp_path, 2, "exit")
    assert str(err).startswith("rank 1 of 2 failed: exit code 3")
    assert err.exit_codes[1] == 3 and err.exit_codes[0] != 0
    assert detect_s < LIMIT_S / 2, f"took {detect_s:.1f} s"


def test_collective_times_out_and_silent_rank_is_stopped(tmp_path):
    start = time.monotonic()
    err, _ = _expect_failure(tmp_path, 2, "sleep", timeout_s=3)
    assert str(err).startswith("rank 0 of 2 failed: ")
    # the silent rank is told that rank 0 failed and exits on its own (its watchdog thread)
    assert "Timed out" in str(err)
    assert str(err).endswith("; then rank 1: stopped after rank 0 of 2 failed (exit code 1)")
    assert err.exit_codes == [1, 1]
    assert time.monotonic() - start < LIMIT_S


def test_sigkill_mid_collective_ends_every_rank(tmp_path):
    caught: list[BaseException] = []

    def run() -> None:
        try:
            launch_local(_failing_worker, 3, ("kill", str(tmp_path)), run_timeout_s=120)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            caught.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    pids = _pids(tmp_path, 3)
    time.sleep(0.3)  # the ranks are looping over 1 MiB ring all-reduces
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    thread.join(LIMIT_S)
    detect_s = time.monotonic() - killed
    assert not thread.is_alive(), "launch_local still running 60 s after the kill"
    assert len(caught) == 1 and isinstance(caught[0], RankFailure), caught
    err = caught[0]
    assert str(err).startswith("rank 1 of 3 failed: killed by SIGKILL (exit code -9)"), str(err)
    assert err.rank == 1 and err.exit_codes[1] == -signal.SIGKILL
    assert all(code != 0 for code in err.exit_codes), err.exit_codes
    assert not any(_alive(pid) for pid in pids) and _rank_children() == []
    assert detect_s < LIMIT_S / 2, f"took {detect_s:.1f} s"


def test_run_timeout_stops_ranks(tmp_path):
    expect = r"run exceeded run_timeout_s=8 s .*stopped rank\(s\) 0"
    with pytest.raises(RankFailure, match=expect) as info:
        launch_local(_sleeping_worker, 1, (str(tmp_path),), run_timeout_s=8)
    assert info.value.rank is None and info.value.exit_codes == [-signal.SIGTERM]
    assert _rank_children() == []


def test_ranks_exit_when_the_launcher_dies(tmp_path):
    code = (
        "import sys, test_launch\n"
        "from shardwise.runtime.launch import launch_local\n"
        "launch_local(test_launch._sleeping_worker, 2, (sys.argv[1],))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS])}
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env)
    try:
        pids = _pids(tmp_path, 2)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), "ranks outlived their launcher by 10 s"
    finally:
        launcher.kill()


def test_launch_rejects_bad_input():
    with pytest.raises(ShardwiseError, match="module-level function"):
        launch_local(lambda rank, world_size: rank, 2)
    with pytest.raises(ShardwiseError, match="unknown backend 'mpi'"):
        launch_local(_context_worker, 2, backend="mpi")
    with pytest.raises(ShardwiseError, match="world_size must be at least 1"):
        launch_local(_context_worker, 0)


def test_init_from_env_names_missing_variables(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    missing = "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: start with torchrun"
    with pytest.raises(ShardwiseError, match=missing):
        init_from_env("gloo")
    with pytest.raises(ShardwiseError, match="no process group"):
        RankContext.current()


def test_init_from_env_unreachable_master_names_address(monkeypatch):
    port = free_port()  # nothing listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    expect = f"rank 1 of 2 could not rendezvous via master 127.0.0.1:{port} "
    with pytest.raises(ShardwiseError, match=expect):
        init_from_env("gloo", timeout_s=1)
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()


def test_torchrun_two_nodes_on_loopback(tmp_path):
    """Two torchrun 'nodes' (one process each) meet through init_from_env."""
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from shardwise.runtime.rendezvous import RankContext, init_from_env\n"
        "rank, world_size = init_from_env('gloo', timeout_s=60)\n"
        "t = torch.tensor([float(rank + 1)])\n"
        "dist.all_reduce(t)\n"
        "print(f'RESULT {RankContext.current()} sum={t.item()}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    for node, out in enumerate(outputs):
        line = next(line for line in out.splitlines() if "RESULT" in line)
        assert f"rank={node}, world_size=2, local_rank=0, backend='gloo'" in line
        assert line.endswith("sum=3.0")


def test_the_rendezvous_port_is_outside_the_ephemeral_range():
    """The launcher's port is one no outgoing connection can be given meanwhile (a bind(0) port is
    ephemeral: another process took one before rank 0's bind in CI); it binds now."""
    lo, hi = _ephemeral_range()
    ports = {launcher_port("127.0.0.1") for _ in range(20)}
    assert len(ports) > 1 and not any(lo <= p <= hi for p in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
    with pytest.raises(ShardwiseError, match="cannot resolve the master address"):
        launcher_port("no-such-host.invalid")
