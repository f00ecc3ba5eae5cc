"""llama.cpp as the decode benchmark's peer (``bench_decode.py``): the benchmark checkpoint as GGUF at F32, BF16,
Q8_0 and Q4_0 (llama.cpp's own quantizer), bytes per token as llama.cpp stores them, and its decode speed through
llama-cpp-python (built from source: ``pip install llama-cpp-python gguf``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

SHORT_BECAUSE = (
    "short because llama.cpp rounds each block of 32 activations to int8 and multiplies int8 by int8 "
    "(VNNI dot products, 64 multiply-adds per instruction), while shardwise keeps the activations as they are "
    "(within 1e-7 of the dequantized product) and turns every weight into a float (float32 rows: 16 products "
    "per fused multiply-add) or a bfloat16 (bfloat16 rows, 32 products per vdpbf16ps) in registers: its kernel "
    "is bound by those instructions, not by memory (int4, 2 threads, 256 MB in huge pages, AMD EPYC Zen 4 VM: "
    "bfloat16 rows 26-27 GB/s of packed rows whether sum() reads 33 or 57 GB/s; from L1 one core computes "
    "23-26 GB/s of them with bfloat16 rows and 11-14 with float32 rows)"
)
"""Why shardwise's int kernel trails llama.cpp's at the same format, printed beside a ratio below 1."""


LLAMA_CPP_FORMATS = {"F32": None, "BF16": 32, "Q8_0": 7, "Q4_0": 2}  # name -> llama_ftype (llama.h) to quantize to


def gguf_files(folder: Path) -> dict[str, Path]:
    """The checkpoint as GGUF at each of ``LLAMA_CPP_FORMATS``, written once beside it: F32 by
    ``shardwise.testing.llama_gguf`` (what llama.cpp's converter writes; the tokenizer copied from a
    tiny checkpoint, padded to the vocabulary), the others by llama.cpp's own ``llama_model_quantize``."""
    import shutil
    import tempfile

    import llama_cpp

    from shardwise.runtime.checkpoint import make_checkpoint
    from shardwise.testing.llama_gguf import write_llama_gguf

    files = {fmt: folder / f"gguf-{fmt.lower()}.gguf" for fmt in LLAMA_CPP_FORMATS}
    if not files["F32"].exists():
        with tempfile.TemporaryDirectory() as tmp:
            tiny = make_checkpoint("llama-3.1-8b", "tiny", Path(tmp) / "tiny", seed=0)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tiny / name, folder / name)
        write_llama_gguf(folder, files["F32"].with_suffix(".partial"), "f32").rename(files["F32"])
    for fmt, ftype in LLAMA_CPP_FORMATS.items():
        if ftype is not None and not files[fmt].exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype, params.nthread = ftype, os.cpu_count() or 1
            partial = files[fmt].with_suffix(".partial")
            if llama_cpp.llama_model_quantize(str(files["F32"]).encode(), str(partial).encode(), params) != 0:
                raise RuntimeError(f"llama.cpp could not quantize to {fmt}")
            partial.rename(files[fmt])
    return files


def llama_cpp_files(folder: Path) -> dict[str, Path]:
    """``gguf_files(folder)``, or none (printed) when llama-cpp-python or gguf is not installed."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        print(f"llama.cpp left out: {exc} (pip install llama-cpp-python gguf)")
        return {}
    return gguf_files(folder)


def gguf_token_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors one decode token reads: all but the token embedding (one row)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    total = 0
    for t in reader.tensors:
        total += int(t.n_bytes) // (int(t.shape[-1]) if t.name == "token_embd.weight" else 1)
    return total


def repacks_safely(path: Path, prompt: list[int], tokens: int, threads: int) -> bool:
    """Whether llama.cpp evaluates ``prompt`` on this GGUF with its extra buffer types (weights repacked at load
    for its AMX or interleaved AVX-512 kernels; its default) without crashing, tried in a child process: on a Xeon
    VM with AMX, llama-cpp-python 0.3.36 built natively died of a segmentation fault in its first Q8_0 / Q4_0
    prompt after repacking the weights for AMX, taking the whole process with it."""
    code = ("import sys, llama_cpp; llm = llama_cpp.Llama(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]), "
            "n_threads_batch=int(sys.argv[3]), n_batch=int(sys.argv[4]), verbose=False); llm.eval(list(range(1, int(sys.argv[4]) + 1)))")
    args = [str(path), str(len(prompt) + tokens + 8), str(threads), str(len(prompt))]
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, timeout=900).returncode == 0


def llama_cpp_rate(path: Path, prompt: list[int], tokens: int, threads: int, timed: Callable[[Callable[[], float]], T],
                   repack: bool = True) -> T:
    """``timed(decode)`` (bench_decode: llama.cpp's decode tok/s on one GGUF and its moment's read GB/s), where
    ``decode()`` times ``tokens`` single-token evaluations after the prompt (one forward and its logits each, as a
    decode step; no sampling) and returns tok/s. Without ``repack`` llama.cpp's extra buffer types are off (the
    weights stay as stored: llama.cpp's ``--no-repack``)."""
    import llama_cpp
    import llama_cpp.llama as binding

    defaults = binding.llama_cpp.llama_model_default_params

    def no_repack():
        params = defaults()
        params.use_extra_bufts = False
        return params

    binding.llama_cpp.llama_model_default_params = defaults if repack else no_repack
    try:
        llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + tokens + 8, n_threads=threads, n_threads_batch=threads,
                              n_batch=len(prompt), verbose=False)
    finally:
        binding.llama_cpp.llama_model_default_params = defaults
    llm.eval(prompt)
    llm.eval([prompt[-1]])  # warm-up step

    def decode() -> float:
        t0 = time.perf_counter()
        for i in range(tokens):
            llm.eval([prompt[i % len(prompt)]])
        return tokens / (time.perf_counter() - t0)

    result = timed(decode)
    llm.close()
    return result
