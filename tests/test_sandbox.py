"""The sandbox with real processes: ordinary programs, then escape attempts that must fail with a
clear result, each leaving the host as it was (no working directory, no process of a sandbox uid,
no child of this process). Where a check could pass vacuously, the same program is also run with
isolation "none" to show that the check does see an escape when there is one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import psutil
import pytest

from prl.sandbox import SandboxPool, SandboxUnavailable, isolation as iso, run

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None,
    reason="the sandbox needs root (to switch uid) and bubblewrap (bin/test installs it)")


# This file's executions get uids of their own, so that sandboxes other tests run at the same time
# on this machine neither trip nor hide the checks for leftover processes.
TEST_UID_BASE = 1_950_000_000


def sandbox_procs() -> list[psutil.Process]:
    """Live processes of this file's sandbox uids (the probe's uid included)."""
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        uids = p.info["uids"]
        if uids and any(TEST_UID_BASE <= u <= TEST_UID_BASE + iso.UID_SLOTS for u in uids) \
                and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.fixture(autouse=True)
def host_unchanged(monkeypatch):
    """Every test: executions' folders go under a folder of the test (one other users may enter, as
    isolation "none" needs), which must be empty after; no process of a sandbox uid and no child of
    this process may remain."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # the session's own (sshd rig, servers)
    runs = Path(tempfile.mkdtemp(prefix="prl-test-runs-"))
    runs.chmod(0o711)
    monkeypatch.setenv("PRL_SANDBOX_TMP", str(runs))
    monkeypatch.setattr(iso, "UID_BASE", TEST_UID_BASE)
    monkeypatch.setenv("PRL_SANDBOX_UID_BASE", str(TEST_UID_BASE))  # for `prl sandbox run`
    assert sandbox_procs() == []
    yield runs
    try:
        assert list(runs.iterdir()) == [], "an execution's working directory was left behind"
        assert sandbox_procs() == [], "a sandboxed process survived its execution"
        assert [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        shutil.rmtree(runs)


@pytest.fixture
def world_readable_dir():
    """A folder anyone on the host may read (so only isolation, not permissions, can hide it)."""
    d = Path(tempfile.mkdtemp(prefix="prl-test-rundir-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_normal_program_output_exit_code_and_identity():
    code = textwrap.dedent("""
        import json, os, sys
        print("out", sys.argv[1:], open("data.txt").read(), sys.stdin.read())
        print("err", file=sys.stderr)
        status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
        print(json.dumps({"uids": os.getresuid(), "gids": os.getresgid(), "groups": os.getgroups(),
                          "cap_eff": int(status["CapEff"], 16), "cwd": os.getcwd(), "pid": os.getpid()}))
        sys.exit(3)
    """)
    r = run(code, files={"data.txt": "D"}, stdin="IN", args=["a1"])
    assert (r.exit_code, r.killed_reason, r.timed_out, r.signal) == (3, None, False, None)
    first, second = r.stdout.splitlines()
    assert first == "out ['a1'] D IN" and r.stderr == "err\n"
    me = json.loads(second)
    uid = me["uids"][0]
    assert iso.UID_BASE <= uid < iso.UID_BASE + iso.UID_SLOTS  # a real kernel uid, not (mapped) root
    assert me["uids"] == [uid] * 3 and me["gids"] == [uid] * 3 and me["groups"] == [] and me["cap_eff"] == 0
    assert me["cwd"] == "/work" and me["pid"] == 2  # its own pid namespace: prl's init is 1
    assert r.wall_s > 0 and r.cpu_s > 0 and (r.max_rss_mb is None or r.max_rss_mb > 0)


def test_a_shell_program_runs_too():
    r = run("echo $0 $(id -u); exit 4", language="sh")
    assert r.exit_code == 4 and r.stdout.split()[0] == "main.sh" and int(r.stdout.split()[1]) >= iso.UID_BASE


def test_program_that_raises_has_its_traceback_and_exit_code_1():
    r = run("def f():\n    raise ValueError('boom')\nf()\n")
    assert r.exit_code == 1 and r.killed_reason is None
    assert "Traceback (most recent call last)" in r.stderr and "ValueError: boom" in r.stderr


def test_fork_bomb_is_contained_and_killed(host_unchanged):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    seen, done = [], threading.Event()
    result = {}

    def go():
        result["r"] = run(bomb, timeout_s=5, max_procs=24)  # time for the sandbox to start on a busy machine
        done.set()

    worker = threading.Thread(target=go)
    worker.start()
    while not done.is_set():  # count the bomb's processes (not prl's killer, `kill -9 -- -1` as the same uid)
        seen.append(sum(1 for p in sandbox_procs() if not " ".join(_cmdline(p)).endswith("-9 -- -1")))
        done.wait(0.05)
    worker.join()
    r = result["r"]
    assert r.killed_reason == "timeout" and r.timed_out and r.signal == "SIGKILL"
    assert 1 < max(seen) <= 24, f"process counts seen during the bomb: {sorted(set(seen))}"


def test_memory_hog_is_refused_memory():
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    r = run(hog, memory_mb=200, timeout_s=30)
    assert r.killed_reason == "memory" and r.exit_code != 0 and "MemoryError" in r.stderr
    assert r.max_rss_mb is None or r.max_rss_mb < 200  # None: this test process peaked above it


def test_infinite_loop_and_endless_sleep_time_out():
    spin = run("while True:\n    pass\n", timeout_s=1, cpu_s=60)
    sleep = run("import time\ntime.sleep(1000)\n", timeout_s=1)
    for r in (spin, sleep):
        assert r.timed_out and r.killed_reason == "timeout" and r.signal == "SIGKILL"


def test_cpu_burner_hits_the_cpu_limit():
    r = run("while True:\n    pass\n", cpu_s=1, timeout_s=60)
    assert r.killed_reason == "cpu" and r.signal == "SIGXCPU" and not r.timed_out
    assert r.cpu_s > 0.8  # the kernel samples CPU time by ticks; rusage splits it slightly differently


def test_writes_outside_the_working_directory_fail(tmp_path):
    host_target = tmp_path / "escape.txt"
    code = textwrap.dedent(f"""
        import os
        for path in ["/usr/escape.txt", "/escape.txt", "/root/escape.txt", {str(host_target)!r},
                     "/proc/sys/kernel/hostname", "/dev/escape.txt"]:
            try:
                with open(path, "w") as f:
                    f.write("x")
                print("WROTE", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
        open("/tmp/private.txt", "w").write("x")  # its own tmpfs: allowed, and gone afterwards
        open("inside.txt", "w").write("x")
    """)
    r = run(code)
    assert r.exit_code == 0, r.stderr
    assert "WROTE" not in r.stdout and r.stdout.count("refused") == 6
    assert not host_target.exists() and not Path("/usr/escape.txt").exists() and not Path("/escape.txt").exists()
    assert not Path("/tmp/private.txt").exists()


def test_run_directory_and_its_secret_are_invisible(world_readable_dir):
    secret = world_readable_dir / "secret.txt"
    secret.write_text("TOKEN-1234")
    secret.chmod(0o644)
    code = textwrap.dedent(f"""
        import os
        for attempt in (lambda: open({str(secret)!r}).read(), lambda: os.listdir({str(world_readable_dir)!r}),
                        lambda: os.listdir("/proc/1/root" + {str(world_readable_dir)!r}),
                        lambda: sorted(os.listdir("/proc"))):
            try:
                print("GOT", attempt())
            except OSError as e:
                print("refused", type(e).__name__)
        print("ENV", sorted(os.environ))
    """)
    r = run(code)
    assert r.exit_code == 0, r.stderr
    assert "TOKEN-1234" not in r.stdout and "secret.txt" not in r.stdout
    assert r.stdout.count("refused") == 3
    procs = [line for line in r.stdout.splitlines() if line.startswith("GOT")][0]
    assert str(os.getpid()) not in procs.replace("'", " ").split()  # no host process is visible
    assert "PATH" in r.stdout and "PRL_SANDBOX_TMP" not in r.stdout  # none of the host's environment
    unisolated = run(code, isolation="none")  # the same attempt without namespaces does get it
    assert "TOKEN-1234" in unisolated.stdout


def test_socket_to_a_host_listener_fails():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = textwrap.dedent(f"""
        import socket
        print("interfaces", [name for _, name in socket.if_nameindex()])
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=5)
            print("CONNECTED")
        except OSError as e:
            print("refused", type(e).__name__)
    """)
    try:
        r = run(code)
        assert r.exit_code == 0, r.stderr
        assert "CONNECTED" not in r.stdout and "refused" in r.stdout and "interfaces ['lo']" in r.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()
        unisolated = run(code, isolation="none")  # proves the listener was reachable from the host
        assert "CONNECTED" in unisolated.stdout
    finally:
        listener.close()


@pytest.mark.parametrize("isolation", ["namespaces", "none"])
def test_a_daemon_left_behind_is_killed(isolation):
    code = textwrap.dedent("""
        import os, subprocess
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                subprocess.Popen(["sleep", "1000"], start_new_session=True)
            os._exit(0)
        os.wait()
        print("parent leaves")
    """)
    r = run(code, isolation=isolation)
    assert r.exit_code == 0 and r.stdout == "parent leaves\n" and r.killed_reason is None
    # the fixture checks that no process of any sandbox uid (so no `sleep 1000`) is left


def test_100_mb_of_stdout_is_capped_with_a_marker():
    flood = "import sys\nchunk = 'x' * 65536\nfor _ in range(1600):\n    sys.stdout.write(chunk)\n"
    r = run(flood, max_output_bytes=1 << 20, timeout_s=120)
    assert r.killed_reason == "output" and not r.timed_out
    body, marker = r.stdout[: 1 << 20], r.stdout[1 << 20:]
    assert body == "x" * (1 << 20)
    assert "[prl sandbox: stdout truncated at 1048576 bytes; the program was stopped]" in marker


def test_refuses_without_namespaces_unless_isolation_none(monkeypatch):
    real_tool = iso.tool

    def no_bwrap(name):
        if name == "bwrap":
            raise SandboxUnavailable("the sandbox needs `bwrap` (Debian: apt-get install bubblewrap)")
        return real_tool(name)

    iso._probe.cache_clear()
    monkeypatch.setattr(iso, "tool", no_bwrap)
    try:
        with pytest.raises(SandboxUnavailable, match='refusing to run untrusted code.*bwrap.*isolation="none"'):
            run("print('never')")
        r = run("print('ran')", isolation="none")
        assert r.stdout == "ran\n" and r.isolation == "none"
    finally:
        iso._probe.cache_clear()


def test_cli_prints_one_json_object(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("print('from the cli')\nimport sys\nsys.exit(2)\n")
    out = subprocess.run([sys.executable, "-m", "prl.cli", "sandbox", "run", "--timeout", "20",
                          "--memory", "256", str(program)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {"exit_code", "stdout", "stderr", "timed_out", "killed_reason", "wall_s", "cpu_s",
            "max_rss_mb"} <= set(result)
    assert result["exit_code"] == 2 and result["stdout"] == "from the cli\n" and result["killed_reason"] is None


def test_pool_respects_its_concurrency_limit():
    async def main():
        async with SandboxPool(concurrency=2, timeout_s=30) as pool:
            code = "import time, sys\ntime.sleep(0.3)\nprint(sys.argv[1])\n"
            results = await asyncio.gather(*(pool.run(code, args=[str(i)]) for i in range(6)))
            return pool, results

    pool, results = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert pool.peak_in_flight == 2 and pool.counts["executions"] == 6


def test_pool_a_hanging_program_blocks_neither_the_loop_nor_other_runs():
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        pool = SandboxPool(concurrency=2, timeout_s=300)
        tick_task = asyncio.create_task(ticker())
        hang = asyncio.create_task(pool.run("import time\ntime.sleep(1000)\n"))
        quick = [await pool.run(f"print({i})") for i in range(3)]  # one worker left for these
        hang_done, ticks_seen = hang.done(), ticks
        hang.cancel()
        while pool.in_flight:  # the cancelled execution is stopped and its worker freed
            await asyncio.sleep(0.01)
        tick_task.cancel()
        pool.close()
        return quick, hang_done, ticks_seen, pool

    quick, hang_done, ticks_seen, pool = asyncio.run(main())
    assert [r.stdout for r in quick] == ["0\n", "1\n", "2\n"]
    assert not hang_done and ticks_seen > 1
    assert pool.counts["killed.cancelled"] == 1
