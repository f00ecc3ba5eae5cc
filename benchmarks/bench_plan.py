"""How long `shardwise plan` takes as a whole process (target: under 0.5 s), and one plan call in a process that
has already planned once (issue 16: under 0.3 s per call; what a sweep, `validate` or a server pays per plan).

Run: python benchmarks/bench_plan.py [--runs N]
By default bytecode caching is on, as for an installed package (this sandbox sets
PYTHONDONTWRITEBYTECODE, which makes every run compile shardwise from source: --no-bytecode).
Prints the median and best wall time and the CPU time of the default plan and of `--json`, next to a bare
`python -c pass` start-up measured in the same run, so the ratio is what matters on a noisy box; then the
same commands run through `cli.main` in this process (imports done by a first call), per call.
"""

import argparse
import contextlib
import io
import os
import resource
import statistics
import subprocess
import sys
import time


def wall(cmd: list[str], runs: int, env: dict) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds (user + system of the child) per run, after one warm-up."""
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    times, cpu = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return times, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--no-bytecode", action="store_true",
                    help="keep PYTHONDONTWRITEBYTECODE as set (every run compiles shardwise from source)")
    args = ap.parse_args()
    env = dict(os.environ)
    if not args.no_bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package runs from cached bytecode
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "shardwise plan": [sys.executable, "-m", "shardwise", "plan"],
        "shardwise plan --json": [sys.executable, "-m", "shardwise", "plan", "--json"],
        "shardwise plan --spec-tokens 7": [sys.executable, "-m", "shardwise", "plan", "--spec-tokens", "7"],
    }
    base = None
    print(f"{'command':34s} {'median s':>9s} {'best s':>8s} {'cpu s':>7s} {'vs python':>10s}")
    for name, cmd in cases.items():
        t, cpu = wall(cmd, args.runs, env)
        med = statistics.median(t)
        base = base or med
        print(f"{name:34s} {med:9.3f} {min(t):8.3f} {statistics.median(cpu):7.3f} {med / base:9.1f}x")
    print("target: shardwise plan under 0.5 s")
    print(f"{'in this process, per call':34s} {'median s':>9s} {'best s':>8s} {'cpu s':>7s}")
    for name, cmd in cases.items():
        if name != "python -c pass":
            t, cpu = in_process(cmd[3:], args.runs)
            print(f"{name:34s} {statistics.median(t):9.3f} {min(t):8.3f} {statistics.median(cpu):7.3f}")
    print("target: one plan call under 0.3 s")


def in_process(argv: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of ``shardwise ARGV`` through ``cli.main`` in this process (output discarded),
    per run, after one warm-up call that does the imports."""
    from shardwise import cli

    def once() -> None:
        saved, sys.argv = sys.argv, ["shardwise", *argv]
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                cli.main()
        finally:
            sys.argv = saved

    once()
    times, cpu = [], []
    for _ in range(runs):
        c0, t0 = time.process_time(), time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu


if __name__ == "__main__":
    main()
