"""``shardwise ring`` through the real entry point in a subprocess."""

import json

import pytest

from conftest import run_cli


def two_switch_file(tmp_path):
    lines = ['[cluster]', 'link = "100g-roce"']
    hosts = [name for i in range(1, 5) for name in (f"a{i}", f"b{i}")]
    lines += [f'[[hosts]]\nname = "{h}"' for h in hosts]
    lines += ['[[switches]]\nname = "sw-a"', '[[switches]]\nname = "sw-b"']
    lines += [f'[[links]]\na = "{h}"\nb = "sw-{h[0]}"' for h in hosts]
    lines += ['[[links]]\na = "sw-a"\nb = "sw-b"\nbandwidth_gbps = 1.0\nlatency_s = 1.1e-5']
    path = tmp_path / "two-switches.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_ring_json(tmp_path):
    result = run_cli("ring", "--topology", str(two_switch_file(tmp_path)), "--message-bytes", "8000000", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["listed_order"] == ["a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]
    best = doc["best_order"]
    assert sorted(best) == sorted(doc["listed_order"])
    crossings = sum(best[i][0] != best[(i + 1) % 8][0] for i in range(8))
    assert crossings == 2
    # best: crossing hop = 3 cables x 11 us + 1 MB over the 1 GB/s uplink, 14 steps
    assert doc["best_s"] == pytest.approx(14 * (3 * 1.1e-5 + 1e6 / 1e9))
    # listed = worst: 4 hops share each uplink direction
    assert doc["listed_s"] == pytest.approx(14 * (3 * 1.1e-5 + 4e6 / 1e9))
    assert doc["worst_s"] == pytest.approx(doc["listed_s"])


def test_ring_table(tmp_path):
    result = run_cli("ring", "--topology", str(two_switch_file(tmp_path)))
    assert result.returncode == 0, result.stderr
    assert "best" in result.stdout and "listed" in result.stdout and "worst" in result.stdout


def test_ring_bad_file_is_one_line_exit_2(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[[hosts]]\nname = "h1"\n[[hosts]]\nname = "h2"\n[[links]]\na = "h1"\nb = "h9"\nbandwidth_gbps = 1\nlatency_s = 1e-6\n')
    result = run_cli("ring", "--topology", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "links[0] (line 5): unknown host or switch 'h9'" in lines[0]
