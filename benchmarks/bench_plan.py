"""How long `shardwise plan` takes as a whole process (target: under 0.5 s).

Run: python benchmarks/bench_plan.py [--runs N]
By default bytecode caching is on, as for an installed package (this sandbox sets
PYTHONDONTWRITEBYTECODE, which makes every run compile shardwise from source: --no-bytecode).
Prints the median and best wall time and the CPU time of the default plan and of `--json`, next to a bare
`python -c pass` start-up measured in the same run, so the ratio is what matters on a noisy box.
"""

import argparse
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


if __name__ == "__main__":
    main()
