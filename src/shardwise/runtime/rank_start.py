"""How ``launch_local`` starts its rank processes: forked from a forkserver that imported torch once.

A spawned rank is a fresh interpreter that imports torch and the runtime itself: ~2 s of CPU each on a 2-core
AMD EPYC VM (``python -c "import torch"``), so a tp=4 run there waited ~5 s before its first rendezvous, and
every launch of a long-lived launcher (``bench`` launches three times, a test process dozens) paid it again.
Measured side by side, five tp=2 launches of a rank that imports ``shardwise.runtime.launch``: spawn 13.7 s,
forkserver 2.3 s (2.1 s of it the server's one start). The server (``rank_server``) is started by the
launcher's first launch with fork + exec, imports once, and forks each rank from a process that never ran a
torch op (no thread pool to lose in the fork); it exits with its launcher.

What a spawned rank inherited at its start and a forked one would take from the server's start instead is
handed over explicitly: the launcher's environment (``launch._rank_main`` replaces the rank's with it) and its
standard output and error as they are at the launch (``Stdio``: a launcher whose descriptors 1 / 2 were
redirected since, e.g. by pytest's capture, gets its ranks' output where it now points). Platforms without a
forkserver (Windows) spawn.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import reduction
from multiprocessing.context import BaseContext

SERVER_MODULE = "shardwise.runtime.rank_server"


def context() -> BaseContext:
    """The forkserver context with ``SERVER_MODULE`` preloaded where the platform has one, else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([SERVER_MODULE])  # read when the server starts: the first launch of this process
    return ctx


class Stdio:
    """The launcher's file descriptors 1 and 2 as they are when a rank is started; in the rank, ``attach()``
    makes them its own 1 and 2. Pickled only while a rank starts (``reduction.DupFd`` hands the descriptors
    over with the process)."""

    def __init__(self, fds: tuple[tuple[int, int], ...] = ()):
        self.fds = fds  # (target, descriptor handed over) pairs, in the rank

    def __reduce__(self):
        targets = tuple(fd for fd in (1, 2) if _is_open(fd))  # a launcher may run with either closed
        return Stdio._rebuild, (targets, *(reduction.DupFd(fd) for fd in targets))

    @staticmethod
    def _rebuild(targets: tuple[int, ...], *handles) -> Stdio:
        return Stdio(tuple(zip(targets, (h.detach() for h in handles))))

    def attach(self) -> None:
        """Point this process's descriptors 1 and 2 at the launcher's (those it had open)."""
        for target, fd in self.fds:
            os.dup2(fd, target)
            os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
