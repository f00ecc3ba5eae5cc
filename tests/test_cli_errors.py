"""One error path for the whole CLI: usage errors are one `error:` line with exit 2, Ctrl-C one
line with exit 130, no traceback (issue #18's first two reproductions)."""

import signal
import subprocess
import time

import pytest

from conftest import cli_argv, cli_env, run_cli


@pytest.mark.parametrize("args,needle", [
    (("plan", "--boxes", "abc"), "'--boxes': 'abc' is not a valid int"),
    (("plan", "--context", "nan"), "'--context'"),
    (("run", "--frobnicate"), "No such option: --frobnicate"),
    (("make-checkpoint", "--out", "x"), "Missing option '--model'"),
    (("frob",), "No such command 'frob'"),
])
def test_usage_errors_are_one_line(args, needle):
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "--help" in lines[0]


def test_no_arguments_prints_help():
    proc = run_cli()
    assert proc.returncode == 0 and "Usage:" in proc.stdout and "COMMAND" in proc.stdout and not proc.stderr.strip()


def test_ctrl_c_exits_130_with_one_line_and_no_rank_left():
    """SIGINT to the leader of a multi-rank command (a 2-rank probe takes ~20 s) ends it at once."""
    proc = subprocess.Popen(cli_argv("probe", "--ranks", "2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env())
    time.sleep(6)
    assert proc.poll() is None, "the probe ended before the signal"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: interrupted" and "Traceback" not in err
    time.sleep(1)
    ranks = subprocess.run(["pgrep", "-f", "shardwise-r"], capture_output=True, text=True)
    assert ranks.stdout.strip() == "", ranks.stdout


def test_context_beyond_the_models_positions_is_refused_at_once():
    """--context past max_position_embeddings is one line naming the limit (it used to run the
    box search for more than a minute); a context that fits no layout says how far it searched."""
    proc = run_cli("plan", "--context", "1000000000", timeout=30)
    assert proc.returncode == 2 and "exceeds kimi-k3's 1,048,576 positions" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    far = run_cli("plan", "--model", "deepseek-v3", "--boxes", "8", "--box", "rtx-4090", "--context", "163840",
                  "--link", "10gbe-tcp", timeout=60)
    assert far.returncode == 2 and "error:" in far.stderr and "Traceback" not in far.stderr
