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


WRITER = """
import sys
from prl.metrics import EventLog
log = EventLog(sys.argv[1], sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()
for i in range(3000):
    log.emit("tick", i=i, pad=sys.argv[2] * 4000)
"""


def test_concurrent_writers_leave_whole_lines(tmp_path):
    """Four processes append 3000 events of 4 kB each to one log at once (released together): every
    line is one whole event, and each writer's events are all there, in order."""
    log = tmp_path / "metrics.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(log), name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for name in "abcd"]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        assert p.wait(timeout=120) == 0
    events = [json.loads(ln) for ln in log.read_text().splitlines()]  # a torn line fails to parse here
    for name in "abcd":
        mine = [e for e in events if e["src"] == name]
        assert [e["i"] for e in mine] == list(range(3000)) and all(e["pad"] == name * 4000 for e in mine)
