"""Join the process group of a run: who this process is (``RankContext``) and the rendezvous.

``init_from_env(backend)`` is for processes started by ``torchrun`` across hosts
(``--nnodes N --node-rank I --master-addr HOST --master-port PORT``), which exports
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the ranks that
``runtime.launch.launch_local`` starts on one machine call it too, with those variables
set by the launcher.

``free_port(addr)`` is the port ``launch_local`` offers the ranks when none is given.

Every process group gets a finite ``timeout`` so a collective whose peer vanished
without closing its sockets fails after ``timeout_s`` instead of hanging forever; a
lost TCP connection (a peer process died) fails at once.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.runtime import DEFAULT_TIMEOUT_S  # process-group timeout (s) for rendezvous and collectives

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "RankContext", "check_backend", "check_timeout", "init_from_env",
           "one_line"]

MAX_TIMEOUT_S = 7 * 24 * 3600
"""Largest --timeout (s), a week: far larger values overflow the process group's timedelta in the ranks."""

_BACKENDS = ("gloo", "nccl")
_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_TEXT_LIMIT = 300  # characters kept of one rank's error text
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*:\d+\]\s*")  # "[…/pair.cc:553] " in gloo messages


@dataclass(frozen=True)
class RankContext:
    """Who this process is in the run, handed to model and runtime code.

    ``local_rank`` is the rank's index on its host (selects the GPU under NCCL) and
    ``device`` the torch device its tensors live on (``cuda:local_rank`` for NCCL, CPU
    for gloo).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @classmethod
    def current(cls) -> RankContext:
        """The context of this process; needs an initialised default process group."""
        if not dist.is_initialized():
            raise ShardwiseError(
                "no process group: call init_from_env() or run under launch_local() first"
            )
        backend = str(dist.get_backend())
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        return cls(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, cut to a readable length."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {_SOURCE_PREFIX.sub('', lines[0])}" if lines else type(exc).__name__
    return text if len(text) <= _TEXT_LIMIT else text[: _TEXT_LIMIT - 1] + "…"


def check_backend(backend: str) -> None:
    """Raise unless ``backend`` is one the runtime supports (gloo, nccl) and, for nccl, this host
    has a GPU torch can use (launchers call it before any rank starts)."""
    if backend not in _BACKENDS:
        raise ShardwiseError(f"unknown backend '{backend}': use one of {', '.join(_BACKENDS)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ShardwiseError("--backend nccl needs CUDA GPUs but torch sees none: use --backend gloo")


def init_from_env(backend: str = "gloo", *, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group described by torchrun's environment; returns (rank, world_size).

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, rendezvouses over
    ``env://`` with a ``timeout_s`` (s) limit on the rendezvous and on every later
    collective, and under ``nccl`` selects GPU ``LOCAL_RANK`` first. Returns the current
    (rank, world_size) if a process group already exists.
    """
    check_backend(backend)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [name for name in _ENV_VARS if not os.environ.get(name)]
    if missing:
        raise ShardwiseError(
            f"missing environment variable(s) {', '.join(missing)}: start with torchrun "
            "(--nnodes N --node-rank I --master-addr HOST --master-port PORT) or launch_local()"
        )
    try:
        rank, world_size, local_rank, port = (
            int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
        )
    except ValueError:
        values = ", ".join(f"{name}={os.environ[name]!r}" for name in _ENV_VARS if name != "MASTER_ADDR")
        raise ShardwiseError(f"non-integer launch environment: {values}") from None
    if not 0 <= rank < world_size:
        raise ShardwiseError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
    addr = os.environ["MASTER_ADDR"]
    device_id = None
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise ShardwiseError(
                f"LOCAL_RANK={local_rank} but this host has {torch.cuda.device_count()} GPU(s)"
            )
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    try:
        dist.init_process_group(
            backend,
            init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device_id,
        )
    except (RuntimeError, OSError, ValueError) as exc:  # dist.DistError is a RuntimeError
        raise ShardwiseError(
            f"rank {rank} of {world_size} could not rendezvous via master {addr}:{port} "
            f"({backend}) within {timeout_s:g} s: {one_line(exc)}"
        ) from exc
    return rank, world_size


def check_timeout(seconds: float) -> None:
    """Raise a one-line ShardwiseError unless ``--timeout`` (s) is in (0, MAX_TIMEOUT_S]."""
    if not seconds > 0:
        raise ShardwiseError(f"--timeout must be > 0 seconds, got {seconds:g}")
    if seconds > MAX_TIMEOUT_S:
        raise ShardwiseError(f"--timeout must be at most {MAX_TIMEOUT_S} seconds (a week), got {seconds:g}")


EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's net.ipv4.ip_local_port_range when /proc does not say


def _ephemeral_range() -> tuple[int, int]:
    """The ports this host hands out to ``bind(0)`` and outgoing connections (inclusive)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port free on ``addr`` now and outside the host's ephemeral range, picked at random: a port
    from ``bind(0)`` is an ephemeral one, which another process's outgoing connection (a gloo rank, a
    client socket) can take between this check and rank 0's own bind, which happened in CI. One-line
    error when ``addr`` cannot be bound."""
    lo, hi = _ephemeral_range()
    span = range(10000, lo) if lo - 10000 >= 1000 else range(hi + 1, 65536)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise ShardwiseError(f"cannot resolve the master address {addr}: {exc}") from exc
    rng = random.Random()
    error: OSError | None = None
    for _ in range(200):
        port = rng.choice(span)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((sockaddr[0], port, *sockaddr[2:]))
            except OSError as exc:
                error = exc
                continue
            return port
    raise ShardwiseError(f"cannot bind a rendezvous port on master address {addr} ({error}): give an address "
                         "of this host")
