"""``runtime.kernel_choice``: candidates measured side by side (turns item by item, the order rotating each
round, best of rounds, the process's share of its cores) and the record kept beside a build (read back, measured
once under a lock, written only when ``keep`` says so)."""

from __future__ import annotations

import json
import time

import torch

from shardwise.runtime import kernel_choice


def test_side_by_side_takes_turns_and_keeps_each_best():
    calls = []

    def run(name: str, i: int) -> int:
        calls.append((name, i))
        time.sleep(0.002 if name == "slow" else 0.001)  # 1 MB each: ~1 and ~0.5 GB/s
        return 1_000_000

    rates = kernel_choice.side_by_side(("fast", "slow"), run, count=6, rounds=3)
    assert len(calls) == 18
    for r in range(3):  # item i of round r goes to candidate (i + r) % 2: each item meets both over the rounds
        assert [name for name, _ in calls[6 * r : 6 * r + 6]] == [("fast", "slow")[(i + r) % 2] for i in range(6)]
    assert 0.3 < rates["slow"] < rates["fast"] < 1.1, rates
    assert rates["fast"] > 1.4 * rates["slow"], rates
    assert rates["cpu_share"] < kernel_choice.CONTENDED_SHARE  # sleeping is not holding the cores


def test_side_by_side_sees_a_process_holding_its_cores():
    x = torch.rand(1 << 20)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rates = kernel_choice.side_by_side(("a", "b"), lambda name, i: int(x.sum() * 0) + x.numel() * 4, count=200, rounds=2)
    finally:
        torch.set_num_threads(threads)
    assert rates["a"] > 0 and rates["b"] > 0
    assert rates["cpu_share"] > 0.2, rates  # one busy thread of one: ~1 alone, ~0.5 with the suite's other work beside it


def test_stored_measures_once_and_keeps_only_what_keep_allows(tmp_path):
    measured = []

    def measure():
        measured.append(1)
        return {"a": 2.0, "b": 1.0, "cpu_share": 0.5}

    decide = lambda rates: max(("a", "b"), key=rates.get)  # noqa: E731
    path = tmp_path / "sub" / "choice.json"
    record = kernel_choice.stored(path, measure, decide, keep=lambda record: record["cpu_share"] >= 0.85)
    assert record["choice"] == "a" and not path.exists() and measured == [1]  # contended: serves this call only
    record = kernel_choice.stored(path, measure, decide, keep=lambda record: True)
    assert path.exists() and json.loads(path.read_text()) == record and measured == [1, 1]
    assert kernel_choice.stored(path, measure, decide, keep=lambda record: True) == record and measured == [1, 1]
    path.write_text(json.dumps({"a": 1.0, "b": 3.0, "choice": "b"}))  # no cpu_share: an older record, measured again
    assert kernel_choice.stored(path, measure, decide, keep=lambda record: True)["choice"] == "a" and measured == [1, 1, 1]
    path.write_text(json.dumps({"b": 3.0, "cpu_share": 1.0, "choice": "b"}))  # a candidate it lacks: measured again
    assert kernel_choice.stored(path, measure, decide, lambda record: True, names=("a", "b"))["choice"] == "a"
    assert kernel_choice.stored(path, measure, decide, lambda record: True, names=("a", "b")) == json.loads(path.read_text())
    path.write_text("{not json")  # a torn file is measured again, not an error
    assert kernel_choice.stored(path, measure, decide, keep=lambda record: True)["choice"] == "a"
