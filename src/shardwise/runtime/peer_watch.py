"""Rank liveness: which peer stopped making progress, told to every rank within seconds.

Two watchers share the threshold ``frozen_s()`` and the hooks a rank registers with
``on_peer_failure`` (a server fails its in-flight requests there before the rank exits):

- ``runtime.launch.launch_local`` supervises the ranks it starts on one machine: each rank
  sends its launcher a heartbeat over a pipe, the launcher names the silent one.
- Ranks started by ``torchrun`` (or any launcher that only exports RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT) have no common parent that sees them all, so ``watch_peers``
  (which ``torchrun_group`` runs for every torchrun-started verb) uses the rendezvous store instead: a thread in every rank increments its counter key every
  ``BEAT_S`` and reads every peer's; a peer whose counter has not moved for ``frozen_s()``
  seconds (SIGSTOP, a hung host, a starved process) — or a store that stops answering for
  that long — ends this rank with one line naming it, exit code 1 (a frozen peer on this
  host is killed first: it cannot exit by itself). The heartbeat runs on its
  own thread, so a rank blocked in a collective or busy in a long kernel keeps beating: only a
  process that cannot run at all goes silent. A rank that leaves ``watch_peers`` marks itself
  done, so peers still finishing do not take its silence for a freeze.

The watcher talks to the store over its own client connection: the process group's client
serialises its operations, and a long blocking wait there (``new_group``) would stall the beats.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

from shardwise.errors import ShardwiseError

__all__ = ["BEAT_S", "FROZEN_S", "FROZEN_ENV", "frozen_s", "on_peer_failure", "tell_peer_failure", "torchrun_group",
           "watch_peers"]

BEAT_S = 0.5
"""Seconds between two heartbeats of a rank (and between two looks at its peers')."""

FROZEN_S = 10.0
"""A rank silent for this long (s) has stopped making progress: the run fails, naming it."""

FROZEN_ENV = "SHARDWISE_TEST_FROZEN_S"
"""Testing hook: seconds that replace ``FROZEN_S`` (fault tests that need not prove the default)."""

_STORE_TIMEOUT_S = 5.0  # one store operation may block this long (s) before it counts as a failed look
_HOOK_FLUSH_S = 1.0  # time (s) a rank's hooks get to tell their clients before it exits
_hooks: list[Callable[[str], None]] = []


def frozen_s() -> float:
    """Seconds of silence after which a rank counts as frozen: ``FROZEN_S``, or the testing hook."""
    value = os.environ.get(FROZEN_ENV)
    if value is None:
        return FROZEN_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0.5 < seconds <= 3600:
        raise ShardwiseError(f"{FROZEN_ENV}='{value}' must be seconds in (0.5, 3600], e.g. 3")
    return seconds


def on_peer_failure(hook: Callable[[str], None]) -> None:
    """Inside a rank: call ``hook(reason)`` when a watcher says another rank failed, before this
    rank exits."""
    _hooks.append(hook)


def tell_peer_failure(reason: str) -> None:
    """Run the registered hooks with ``reason`` (errors ignored: the rank exits whatever a hook
    does) and give them ``_HOOK_FLUSH_S`` to reach their clients."""
    for hook in _hooks:
        try:
            hook(reason)
        except Exception:  # noqa: BLE001
            pass
    if _hooks:
        time.sleep(_HOOK_FLUSH_S)


def _stop_if_local(store, peer: int) -> None:
    """SIGKILL ``peer`` when it runs on this host (a frozen process cannot exit by itself; torchrun
    would wait 30 s after its SIGTERM). Peers on other hosts are left to their own torchrun."""
    with contextlib.suppress(Exception):
        host, pid = store.get(f"pid/{peer}").decode().rsplit(" ", 1)
        if host == socket.gethostname() and int(pid) != os.getpid():
            os.kill(int(pid), signal.SIGKILL)


def _exit_naming(rank: int, reason: str) -> None:
    """Tell the hooks, print one line, leave at once (the main thread may be blocked in a collective)."""
    tell_peer_failure(reason)
    sys.stderr.write(f"error: [shardwise rank {rank}] stopping: {reason}\n")
    sys.stderr.flush()
    os._exit(1)


def _watch(store, rank: int, world_size: int, stop: threading.Event, limit_s: float, where: str) -> None:
    """Beat, look at every peer, exit this rank when one (or the store) is silent for ``limit_s``."""
    peers = [r for r in range(world_size) if r != rank]
    seen = {r: -1 for r in peers}
    moved = {r: time.monotonic() for r in peers}
    store_ok = time.monotonic()
    while not stop.wait(BEAT_S):
        now = time.monotonic()
        try:
            store.add(f"beat/{rank}", 1)
            for r in peers:
                count = store.add(f"beat/{r}", 0)
                if count != seen[r]:
                    seen[r], moved[r] = count, now
            store_ok = now
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds for a lost or silent store
            if stop.is_set():
                return
            if now - store_ok > limit_s:
                _exit_naming(rank, f"the rendezvous store at {where} has not answered for {now - store_ok:.0f} s "
                                   f"({type(exc).__name__}): its host or rank 0 stopped")
            continue
        for r in peers:
            silent = now - moved[r]
            if silent > limit_s and not stop.is_set() and not store.add(f"done/{r}", 0):
                _stop_if_local(store, r)
                _exit_naming(rank, f"rank {r} of {world_size} stopped making progress: no heartbeat for "
                                   f"{silent:.0f} s (frozen, stopped or starved)")


@contextlib.contextmanager
def watch_peers(rank: int, world_size: int) -> Iterator[None]:
    """While inside, watch every other rank of this torchrun-started group through the store at
    MASTER_ADDR:MASTER_PORT (call after the rendezvous). A no-op for one rank."""
    if world_size <= 1:
        yield
        return
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=_STORE_TIMEOUT_S)
    client = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted group starts from fresh keys
    store = dist.PrefixStore(f"shardwise/peers/{run}/", client)
    store.set(f"pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(store, rank, world_size, stop, frozen_s(), f"{addr}:{port}"),
                               name="shardwise-peer-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(Exception):  # the store may already be gone at shutdown
            store.add(f"done/{rank}", 1)
        watcher.join(timeout=2 * BEAT_S)


@contextlib.contextmanager
def torchrun_group(backend: str, timeout_s: float) -> Iterator[tuple[int, int]]:
    """How a torchrun-started verb joins its group: the rendezvous (``rendezvous.init_from_env``),
    ``watch_peers`` for as long as the block runs, and the process group destroyed when it ends
    normally. Yields (rank, world_size)."""
    import torch.distributed as dist

    from shardwise.runtime.rendezvous import init_from_env

    rank, world_size = init_from_env(backend, timeout_s=timeout_s)
    with watch_peers(rank, world_size):
        yield rank, world_size
    dist.destroy_process_group()
