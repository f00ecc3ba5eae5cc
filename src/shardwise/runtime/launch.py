"""Start and supervise the ranks of a run on this machine.

``launch_local(fn, world_size)`` starts ``world_size`` processes on this machine
(forked from a server that imported torch once, ``rank_start``), each joins an ``env://``
rendezvous bound to loopback and runs ``fn(rank, world_size, *args)``; the parent
collects the per-rank return values. It supervises them: when one rank raises, exits
or is killed, the launcher tells every other rank which rank failed (each prints
``[shardwise rank R] stopping: rank F of N failed: …`` and exits 1), stops whoever is
still running after a short grace, and raises ``RankFailure`` naming the rank that
went first. Ranks name their OS thread ``shardwise-rR`` (``ps``, ``/proc/PID/comm``).
Processes started by ``torchrun`` across hosts join through
``runtime.rendezvous.init_from_env`` instead (which the launched ranks call too).

Each launched rank also runs a watchdog thread that exits the rank when its parent (the
launcher) disappears, so a killed launcher does not leave ranks behind, and that carries
the launcher's verdict: a rank blocked in a collective (or busy) when a peer dies is told which rank failed, so
its message names it; a rank whose collective failed first waits up to
``_VERDICT_WAIT_S`` for that verdict before reporting the bare communication error.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from typing import Any

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.runtime import DEFAULT_TIMEOUT_S  # process-group timeout (s) for rendezvous and collectives
from shardwise.runtime import rank_start
from shardwise.runtime.peer_watch import frozen_s, on_peer_failure, tell_peer_failure
from shardwise.runtime.rendezvous import check_backend, free_port, init_from_env, one_line

__all__ = ["RankFailure", "launch_local", "on_peer_failure"]

_GRACE_S = 2.0  # after the first failure, time (s) for the other ranks to report and exit on their own
_VERDICT_WAIT_S = 2.0  # a rank whose collective failed waits this long (s) to learn which peer failed
_TERM_WAIT_S = 3.0  # time (s) between SIGTERM and SIGKILL when stopping a rank
_WATCHDOG_PERIOD_S = 0.5  # how often (s) a rank checks that its launcher is still alive and sends a heartbeat
_FIRST_BEAT_S = 60.0  # time (s) a starting rank may take (imports) before its first heartbeat


class RankFailure(ShardwiseError):
    """A launched rank failed (or the run timed out); the other ranks were stopped.

    ``rank`` is the rank that failed first (None when the run timed out with every rank
    still alive) and ``exit_codes`` the final exit code of every rank, in rank order
    (negative: killed by that signal number).
    """

    def __init__(self, message: str, rank: int | None, exit_codes: list[int | None]):
        super().__init__(message)
        self.rank = rank
        self.exit_codes = exit_codes


# --------------------------------------------------------------------------- inside a rank


_exit_lock = threading.Lock()  # one report leaves a rank: the main thread's or the watchdog's


def _send(conn: Connection, message: tuple) -> None:
    """``message`` to the launcher as one plain pickle: tensors travel by value. ``Connection.send`` pickles them
    through torch's shared-memory reductions, whose file descriptors the launcher fetches from the sending
    process: a result read after its rank exited was lost ("exited (exit code 0) without returning a result")."""
    conn.send_bytes(pickle.dumps(message))


def _name_process(rank: int) -> None:
    """Name this process ``shardwise-rR`` for ps/top (Linux only; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(15, f"shardwise-r{rank}".encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass


def _report_and_exit(conn: Connection, message: tuple, stderr_text: str) -> None:
    """Send ``message`` to the launcher, write ``stderr_text``, exit 1 (skipping interpreter
    teardown, which can block on a broken process group). Only the first caller gets through."""
    with _exit_lock:
        sys.stderr.write(stderr_text)
        try:
            _send(conn, message)
        except (OSError, pickle.PicklingError):
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _watch_launcher(rank: int, parent_pid: int, ctl: Connection, conn: Connection) -> None:
    """Exit this rank when the launcher is gone, or when it says another rank failed; send the
    launcher a heartbeat every ``_WATCHDOG_PERIOD_S`` (a frozen process sends none, a rank blocked
    in a collective keeps sending them, so the launcher can tell which rank stopped)."""
    while True:
        with _exit_lock:
            if conn.closed:  # the rank finished and is exiting
                return
            try:
                _send(conn, ("beat",))
            except (OSError, ValueError):  # the launcher is gone
                os._exit(1)
        try:
            ready = ctl.poll(_WATCHDOG_PERIOD_S)
            verdict = ctl.recv() if ready else None
        except (EOFError, OSError):  # the launcher closed its end: it is gone
            os._exit(1)
        try:
            os.kill(parent_pid, 0)  # a rank is the forkserver's child, not the launcher's: ask by pid
        except OSError:  # gone (or its pid is now another user's process)
            os._exit(1)
        if verdict is not None:
            text = verdict[1]
            tell_peer_failure(text)
            _report_and_exit(conn, ("error", "lost", text), f"[shardwise rank {rank}] stopping: {text}\n")


def _is_comm_error(exc: BaseException) -> bool:
    """True for errors caused by a peer going away (secondary failures), not by this rank."""
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and "gloo" in str(exc).lower()
    )


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple,
    env: dict[str, str],
    backend: str,
    timeout_s: float,
    conn: Connection,
    ctl: Connection,
    parent_pid: int,
    stdio: rank_start.Stdio,
) -> None:
    """Body of a launched rank: join the group, run ``fn``, send back the result. ``env`` is the launcher's
    whole environment plus the rank's variables; ``stdio`` its output and error (``rank_start``)."""
    # Ctrl-C is the launcher's to handle (it stops the ranks): a terminal's SIGINT to the whole
    # group, pending since the rank started (with SIGINT blocked, ``rank_server``), is dropped here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    stdio.attach()
    os.environ.clear()
    os.environ.update(env)
    _name_process(rank)
    threading.Thread(target=_watch_launcher, args=(rank, parent_pid, ctl, conn), daemon=True).start()
    threads = os.environ.get("OMP_NUM_THREADS", "")  # the launcher's now, not the server's at its start
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    elif not threads:  # like torchrun: don't oversubscribe the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        init_from_env(backend, timeout_s=timeout_s)
        result = fn(rank, world_size, *args)
        with _exit_lock:
            _send(conn, ("ok", result))
        dist.barrier()  # nobody tears down the store (rank 0) while others still use it
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        comm = _is_comm_error(exc)
        if comm:  # most likely a peer died: the watchdog exits this rank if the launcher says which
            time.sleep(_VERDICT_WAIT_S)
        text = one_line(exc)
        detail = f"{exc}\n" if isinstance(exc, ShardwiseError) else traceback.format_exc()  # input errors: one line
        _report_and_exit(conn, ("error", "comm" if comm else "own", text), f"[shardwise rank {rank}] {detail}")
    with _exit_lock:  # not while the watchdog sends a heartbeat
        conn.close()


# --------------------------------------------------------------------------- the launcher


def _loopback_interface(addr: str) -> str | None:
    """Name of the loopback interface when ``addr`` is a loopback address, else None."""
    try:
        if not ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback:
            return None
    except (OSError, ValueError):
        return None
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), None)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exit code {code}"


class _Supervisor:
    """Watches the ranks' result pipes and process sentinels until done or failed."""

    def __init__(self, procs: list, conns: list[Connection], ctls: list[Connection]):
        self.procs = procs
        self.ctls = ctls
        self.announced = False
        self.open = dict(enumerate(conns))
        self.results: list[Any] = [None] * len(procs)
        self.returned = [False] * len(procs)
        self.reported: dict[int, tuple[str, str]] = {}  # rank -> (kind, one-line text)
        self.exited: dict[int, int] = {}
        self.failed_at: dict[int, float] = {}  # rank -> time.monotonic() of detection
        self.frozen_s = frozen_s()
        start = time.monotonic() + _FIRST_BEAT_S - self.frozen_s
        self.last_beat = [start] * len(procs)  # rank -> time.monotonic() of its last heartbeat

    def _drain(self, rank: int) -> None:
        conn = self.open.get(rank)
        while conn is not None and conn.poll():
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                conn.close()
                del self.open[rank]
                return
            try:
                msg = pickle.loads(data)
            except Exception as exc:  # noqa: BLE001 - e.g. a result of a class the launcher cannot import
                msg = ("error", "own", f"its result could not be read here: {one_line(exc)}")
            if msg[0] == "beat":
                self.last_beat[rank] = time.monotonic()
            elif msg[0] == "ok":
                self.results[rank], self.returned[rank] = msg[1], True
            else:
                self.reported[rank] = (msg[1], msg[2])
                self.failed_at.setdefault(rank, time.monotonic())

    def run(self, run_timeout_s: float | None) -> bool:
        """Wait until every rank exited (True) or a failure/timeout happened (False)."""
        deadline = None if run_timeout_s is None else time.monotonic() + run_timeout_s
        while len(self.exited) < len(self.procs):
            limits = [] if deadline is None else [deadline]
            if self.failed_at:
                limits.append(min(self.failed_at.values()) + _GRACE_S)
            timeout = _WATCHDOG_PERIOD_S
            if limits:
                timeout = min(timeout, min(limits) - time.monotonic())
                if timeout <= 0:
                    return False
            self._check_heartbeats()
            waitables: dict[Any, tuple[str, int]] = {c: ("pipe", r) for r, c in self.open.items()}
            for r, proc in enumerate(self.procs):
                if r not in self.exited:
                    waitables[proc.sentinel] = ("proc", r)
            for obj in wait_ready(list(waitables), timeout):
                kind, r = waitables[obj]
                self._drain(r)
                if kind == "proc":
                    self.procs[r].join()
                    self.exited[r] = self.procs[r].exitcode
                    self._drain(r)
                    if self.exited[r] != 0 or not self.returned[r]:
                        self.failed_at.setdefault(r, time.monotonic())
            if self.failed_at and not self.announced:
                self._announce()
        return not self.failed_at

    def _check_heartbeats(self) -> None:
        """Fail a live rank whose heartbeats stopped for ``frozen_s()`` (its own failure: it is named first)."""
        now = time.monotonic()
        for r, proc in enumerate(self.procs):
            silent = now - self.last_beat[r]
            if r not in self.exited and r not in self.failed_at and silent > self.frozen_s and proc.is_alive():
                self.reported[r] = ("own", f"stopped making progress: no heartbeat for {silent:.0f} s "
                                           "(frozen, e.g. SIGSTOP, or starved of CPU)")
                self.failed_at[r] = now

    def _announce(self) -> None:
        """Tell every rank still running which rank failed first (they report it and exit)."""
        self.announced = True
        first = self._failed_order()[0]
        text = f"rank {first} of {len(self.procs)} failed: {self._describe(first, short=True)}"
        for r, (proc, ctl) in enumerate(zip(self.procs, self.ctls)):
            if r != first and r not in self.exited and proc.is_alive():
                try:
                    ctl.send(("failed", text))
                except OSError:  # it is exiting already
                    pass

    def _describe(self, r: int, short: bool = False) -> str:
        code = self.procs[r].exitcode
        if r in self.reported:
            kind, text = self.reported[r]
            if kind == "comm":  # knock-on errors: the first sentence says enough
                text = text.split(". ")[0]
            elif kind == "lost":
                text = "stopped after " + text.split(": ")[0]
            return text if short else f"{text} ({_describe_exit(code)})"
        if code == 0:
            return "exited (exit code 0) without returning a result"
        return _describe_exit(code)

    def _failed_order(self) -> list[int]:
        """Failed ranks, own failures before knock-on ones (comm errors, stops), then by time."""

        def order(r: int) -> tuple[int, float]:
            secondary = self.reported.get(r, ("own", ""))[0] in ("comm", "lost")
            return (1 if secondary else 0, self.failed_at[r])

        return sorted(self.failed_at, key=order)

    def error(self, world_size: int, stopped: list[int], run_timeout_s: float | None) -> RankFailure:
        """The one-line error naming the first failed rank, then the others."""
        codes = [proc.exitcode for proc in self.procs]
        describe = self._describe
        failed = self._failed_order()
        tail = f"; stopped rank(s) {', '.join(map(str, stopped))}" if stopped else ""
        if not failed:
            return RankFailure(
                f"run exceeded run_timeout_s={run_timeout_s:g} s with {world_size} rank(s) "
                f"still running{tail}",
                None,
                codes,
            )
        first = failed[0]
        others = "".join(f"; then rank {r}: {describe(r)}" for r in failed[1:])
        return RankFailure(
            f"rank {first} of {world_size} failed: {describe(first)}{others}{tail}", first, codes
        )


def _stop(procs: list) -> None:
    """Terminate (SIGTERM, then SIGKILL after a grace time) and reap every live process; a stopped
    one (SIGSTOP) is continued too, so that it handles the SIGTERM at once instead of at the SIGKILL."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:  # it exited meanwhile
                pass
    give_up = time.monotonic() + _TERM_WAIT_S
    for proc in procs:
        proc.join(max(0.0, give_up - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    run_timeout_s: float | None = None,
    forward_signals: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` local processes; return their results.

    ``fn`` and ``args`` must be picklable (a module-level function) and so must each
    rank's return value; the list is in rank order. Each process joins an ``env://``
    rendezvous on ``master_addr:master_port`` (a free port when None) before ``fn``
    runs, with ``timeout_s`` (s) on the rendezvous and on every collective; with a
    loopback ``master_addr`` gloo traffic is bound to the loopback interface too.
    Ranks see the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), so ``RankContext.current()`` works inside ``fn``, and
    use cpu_count // world_size threads unless OMP_NUM_THREADS is set.

    If a rank raises, exits or is killed, the others are stopped (SIGTERM, then SIGKILL
    after 3 s) and ``RankFailure`` (a ``ShardwiseError``) names the first failed rank
    with its exception text or exit code; the rank's traceback goes to stderr (a ShardwiseError's
    message alone: an input error is one line). The same
    happens, naming no rank, when ``run_timeout_s`` (s, None for no limit) elapses.
    """
    check_backend(backend)
    if world_size < 1:
        raise ShardwiseError(f"world_size must be at least 1, got {world_size}")
    port = master_port if master_port is not None else free_port(master_addr)
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }
    loopback = _loopback_interface(master_addr)
    if backend == "gloo" and loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = loopback
    ctx = rank_start.context()
    procs: list = []
    conns: list[Connection] = []  # rank -> launcher: the result or the error
    ctls: list[Connection] = []  # launcher -> rank: which rank failed
    # SIGINT waits until every rank is started (each starts with it blocked and drops it once its
    # bootstrap is done: a Ctrl-C mid-start stops them cleanly instead of a traceback per child)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            ctl_reader, ctl_writer = ctx.Pipe(duplex=False)
            conns.append(reader)
            ctls.append(ctl_writer)
            rank_env = {**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, tuple(args), rank_env, backend, timeout_s, writer,
                      ctl_reader, os.getpid(), rank_start.Stdio()),
                name=f"shardwise-rank{rank}",
            )
            procs.append(proc)
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise ShardwiseError(
                    f"cannot send fn/args to the ranks (use a module-level function and "
                    f"picklable args): {one_line(exc)}"
                ) from exc
            finally:
                writer.close()
                ctl_reader.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if forward_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: procs[0].is_alive() and os.kill(procs[0].pid, signal.SIGTERM))
        supervisor = _Supervisor(procs, conns, ctls)
        if supervisor.run(run_timeout_s):
            return supervisor.results
        stopped = [r for r, proc in enumerate(procs) if proc.is_alive()]
        _stop(procs)
        raise supervisor.error(world_size, stopped, run_timeout_s)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        _stop([proc for proc in procs if proc.pid is not None])
        for conn in conns + ctls:
            conn.close()
