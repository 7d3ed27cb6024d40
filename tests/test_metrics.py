"""Typed error events: a process that dies of an exception says so in metrics.jsonl (type and
message), a normal stop does not, and the event log stays whole lines under concurrent writers."""

import json
import subprocess
import sys

import pytest

PROGRAM = """
import sys
from prl.metrics import EventLog, reporting_errors
with reporting_errors(EventLog(sys.argv[1], "proc"), "worker-3"):
    {body}
"""


@pytest.mark.parametrize("body, rc, expected", [
    ("raise ValueError('bad reward for prompt 7')", 1, [("ValueError", "ValueError: bad reward for prompt 7")]),
    ("raise SystemExit(0)", 0, []),
    ("raise SystemExit('torchrun exited first')", 1, [("SystemExit", "torchrun exited first")]),
    ("raise KeyboardInterrupt", -2, []),
    ("pass", 0, []),
])
def test_a_process_reports_the_exception_that_ended_it(tmp_path, body, rc, expected):
    log = tmp_path / "metrics.jsonl"
    p = subprocess.run([sys.executable, "-c", PROGRAM.format(body=body), str(log)], capture_output=True, text=True)
    assert p.returncode == rc, p.stderr
    events = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    assert [(e["type"], e["line"]) for e in events] == expected
    assert all(e["kind"] == "error" and e["name"] == "worker-3" for e in events)
