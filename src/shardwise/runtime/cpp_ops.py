"""The runtime's own compiled CPU ops (``csrc/*.cpp``): built on first use, once per machine.

Each source registers its ops in a ``TORCH_LIBRARY`` namespace; ``load(source)`` compiles it
with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~10-20 s once per machine, cached
under ``~/.cache/torch_extensions``) for the CPU it runs on (``-march=native``: AVX-512, AVX2+FMA
or portable C++), with OpenMP so ``at::parallel_for`` splits work over torch's own threads (the
``libgomp.so.1`` torch ships is already loaded and is the one it binds to), and loads it into
this process once. A build says so on stderr (one line), so the pause is not a mystery.

Ranks starting together build it once: the build runs under an ``flock`` (released by the
kernel if the builder dies), and a lock file torch's own build left behind when its process was
killed is removed first — otherwise every later build would wait for it forever.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

__all__ = ["build_dir", "first_line", "load", "optional_op"]

_CSRC = Path(__file__).with_name("csrc")
_loaded: set[str] = set()
_optional: dict[tuple[str, str], object] = {}  # (namespace, name): the op or None, decided once per process


def load(source: str) -> None:
    """Build (if this machine has no build of this text yet) and load ``csrc/<source>``; raises
    what the build or the loader raised (``RuntimeError``, ``OSError``, ``ImportError``)."""
    if source in _loaded:
        return
    from torch.utils.cpp_extension import load as build_extension

    build = build_dir(source)
    name = build.name
    library = build / f"{name}.so"
    if not library.exists():
        build.mkdir(parents=True, exist_ok=True)
        with open(build.parent / f"{name}.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            if not library.exists():
                (build / "lock").unlink(missing_ok=True)
                print(f"shardwise: compiling {source} for this CPU (once per machine, ~15 s)", file=sys.stderr, flush=True)
                build_extension(name, [str(_CSRC / source)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False,
                                verbose=False)
    torch.ops.load_library(str(library))
    _loaded.add(source)


def optional_op(source: str, namespace: str, name: str):
    """``torch.ops.<namespace>.<name>`` from ``csrc/<source>``, or None where it cannot run here: the
    source does not build (no compiler) or this CPU's build registers no such op; decided once per
    process. For ops the runtime can do without (the torch ops then run)."""
    key = (namespace, name)
    if key not in _optional:
        try:
            load(source)
            _optional[key] = getattr(getattr(torch.ops, namespace), name, None)
        except (RuntimeError, OSError, ImportError):
            _optional[key] = None
    return _optional[key]


def first_line(exc: BaseException) -> str:
    """The first line of a failed build's error (compiler output can run to pages)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def build_dir(source: str) -> Path:
    """Where this machine's build of ``csrc/<source>`` lives: one folder per source text (and the headers
    beside it), CPU flags, Python and torch version (``$TORCH_EXTENSIONS_DIR`` or torch's default root)."""
    from torch.utils.cpp_extension import get_default_build_root

    flags = _flags_line()
    headers = b"".join(path.read_bytes() for path in sorted(_CSRC.glob("*.h")))
    key = (_CSRC / source).read_bytes() + headers + f"{flags}|{sys.version}|{torch.__version__}".encode()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"shardwise_{Path(source).stem}_{hashlib.sha1(key).hexdigest()[:12]}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (``avx512_bf16``, ``amx_tile``, ...); empty where unknown. Read
    once per process."""
    return frozenset(_flags_line().partition(":")[2].split())


@functools.cache
def _flags_line() -> str:
    """/proc/cpuinfo's first ``flags`` line ('' where unknown), read once per process."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""
