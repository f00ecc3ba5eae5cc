"""All-reduce (SUM) through shared memory, for a group whose ranks all run on one host.

On one machine the TCP path costs far more than the bytes: a 8 KB gloo all-reduce between two
idle local ranks took 0.34–1.5 ms here, against ~15 µs through shared memory — and a decode
step makes two per layer. vLLM's CPU backend and SGLang's CPU kernels do the same for ranks on
one host (a shared segment, per-rank slots, a flag each rank raises).

Layout of the segment (a file under /dev/shm, unlinked as soon as every rank mapped it, so
nothing is left behind whatever happens to the processes): one 64-byte flag line per rank, then
two buffers (alternating by call parity) of ``world × CAPACITY_BYTES`` — a slot per rank. A call
copies this rank's tensor into its slot of this parity's buffer, raises its flag to the call
number, waits until every flag reached it, then sums the slots **in rank order** (the same
additions on every rank: bit-identical results, as ``oneshot_allreduce``'s documented order).
Two buffers suffice: a rank can only reach call ``s + 2`` (and overwrite parity ``s``) after
every rank raised its flag for ``s + 1``, which each does only after reading call ``s``.
Messages larger than a slot go in slot-sized pieces.

The wait spins (``_SPIN`` polls, a few milliseconds holding the GIL; 20 polls in a group with more
ranks than cores, so ranks that share cores with their peers still progress), then naps (20 µs
sleeps); it gives up after ``DEFAULT_TIMEOUT_S`` (a dead peer is normally caught sooner by the
launcher's or ``peer_watch``'s heartbeats). It never yields the CPU with ``os.sched_yield``: a
thread that drops and retakes the GIL every few milliseconds keeps CPython from ever forcing a
switch, and the heartbeat thread starved (a frozen peer was named after 9-17 s instead of 3).
Ordering of the data and flag stores relies on x86-64's total store order, so the algorithm
refuses other architectures (use ``rd``/``ring``).
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.runtime import DEFAULT_TIMEOUT_S

__all__ = ["CAPACITY_BYTES", "shm_reduce"]

CAPACITY_BYTES = 4 << 20
"""Bytes of one rank's slot per buffer; larger messages are reduced in pieces of this size."""

_FLAG_BYTES = 64  # one cache line per rank's flag
_SPIN = 2000  # busy polls (~1.3 µs each) before the wait starts napping
_SPIN_CROWDED = 20  # the same when the group has more ranks than this process has cores
_NAP_S = 20e-6  # seconds of one nap (the GIL released)
_states: dict[object, _Segment] = {}


class _Segment:
    """The mapped segment of one process group and this rank's position in it."""

    def __init__(self, ranks: list[int], group):
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise ShardwiseError(f"--allreduce shm relies on x86-64 store ordering, this is {platform.machine()}: "
                                 "use ring, rd or builtin")
        self.ranks = ranks
        self.world, self.me = len(ranks), ranks.index(dist.get_rank())
        hosts: list = [None] * self.world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) != 1:
            raise ShardwiseError(f"--allreduce shm needs every rank on one host, these run on {sorted(set(hosts))}: "
                                 "use ring, rd or two-level")
        size = self.world * _FLAG_BYTES + 2 * self.world * CAPACITY_BYTES
        name = [f"/dev/shm/shardwise-allreduce-{uuid.uuid4().hex}" if self.me == 0 else None]
        dist.broadcast_object_list(name, src=self.ranks[0], group=group)
        path = name[0]
        if self.me == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        dist.barrier(group=group)
        if self.me != 0:
            fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(fd, size)
        os.close(fd)
        dist.barrier(group=group)  # everyone mapped it: the name can go
        if self.me == 0:
            os.unlink(path)
        raw = torch.frombuffer(self.map, dtype=torch.uint8)
        self.flags = np.frombuffer(self.map, dtype=np.int64, count=self.world * _FLAG_BYTES // 8)[:: _FLAG_BYTES // 8]
        # more ranks than cores: a spinning rank would hold the core a peer needs, so sleep instead
        self.crowded = self.world > len(os.sched_getaffinity(0))
        self.buffers = raw[self.world * _FLAG_BYTES:].view(2, self.world, CAPACITY_BYTES)
        self.calls = 0
        self.views: dict[tuple, list[torch.Tensor]] = {}

    def _wait(self, call: int) -> None:
        """Return once every rank's flag reached ``call``: spin, then nap."""
        flags = self.flags
        for _ in range(_SPIN_CROWDED if self.crowded else _SPIN):
            if flags.min() >= call:
                return
        deadline = time.monotonic() + DEFAULT_TIMEOUT_S
        while flags.min() < call:
            time.sleep(_NAP_S)
            if time.monotonic() > deadline:
                late = [self.ranks[r] for r in range(self.world) if int(flags[r]) < call]
                raise ShardwiseError(f"shm all-reduce: rank(s) {late} did not arrive within {DEFAULT_TIMEOUT_S:g} s")

    def _slots(self, parity: int, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's slot of buffer ``parity`` as ``nbytes`` of ``dtype`` (views cached per shape)."""
        key = (parity, nbytes, dtype)
        if key not in self.views:
            self.views[key] = list(self.buffers[parity, :, :nbytes].view(dtype))
        return self.views[key]

    def reduce(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` (contiguous, 1-D) over the group in place, in slot-sized pieces."""
        step = CAPACITY_BYTES // flat.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            self.calls += 1
            parts = self._slots(self.calls & 1, piece.numel() * piece.element_size(), flat.dtype)
            # x·1 is x bit for bit; an arithmetic kernel writes with ordinary stores, which x86 keeps
            # in order before the flag's (a large memcpy may use non-temporal stores, which it does not)
            torch.mul(piece, 1, out=parts[self.me])
            self.flags[self.me] = self.calls
            self._wait(self.calls)
            torch.add(parts[0], parts[1], out=piece)
            for r in range(2, self.world):
                piece += parts[r]


def shm_reduce(flat: torch.Tensor, ranks: list[int], group) -> None:
    """Sum the contiguous 1-D CPU tensor ``flat`` in place over ``group`` (global ``ranks``, in group
    order) through its shared-memory segment, set up on the group's first call (a collective: every
    rank of the group calls it). ``comm.shm_allreduce`` is the registered entry point."""
    if flat.device.type != "cpu":
        raise ShardwiseError("--allreduce shm reduces CPU tensors: use builtin (NCCL) on GPUs")
    key = group if group is not None else "default"
    if key not in _states:
        _states[key] = _Segment(ranks, group)
    _states[key].reduce(flat)
