"""The host layer against real hosts: this machine, and real sshd servers on loopback addresses."""

import time

import pytest

from prl.launch.hosts import HostError, LocalHost, SshHost, SshTarget


def ssh(rig, i=0, **kw) -> SshHost:
    h = rig["hosts"][i]
    return SshHost(SshTarget(h.address, "root", h.port, rig["key"], kw.pop("known", rig["known"]), **kw))


@pytest.fixture(params=["local", "ssh"])
def host(request, rig):
    h = LocalHost() if request.param == "local" else ssh(rig)
    yield h
    h.close()


def test_run_and_copy(host, tmp_path):
    r = host.run("echo hello; echo oops >&2; exit 3")
    assert (r.code, r.stdout.strip(), r.stderr.strip()) == (3, "hello", "oops")
    src = tmp_path / "a.txt"
    src.write_text("payload")
    host.put(src, str(tmp_path / "remote" / "b.txt"))
    host.get(str(tmp_path / "remote" / "b.txt"), tmp_path / "c.txt")
    assert (tmp_path / "c.txt").read_text() == "payload"


def test_start_stream_and_stop_a_process_group(host, tmp_path):
    log = str(tmp_path / "logs" / "p.log")
    # a parent that ignores TERM and a child: only the group KILL after the grace period ends both
    pid = host.start(["sh", "-c", "trap '' TERM; echo started $PRL_X; sleep 300 & sleep 300; wait"], log,
                     env={"PRL_X": "42"})
    deadline = time.time() + 60  # only how long a failure takes to show
    data, offset = b"", 0
    while b"started 42" not in data and time.time() < deadline:
        chunk, offset = host.read_log(log, offset)
        data += chunk
        time.sleep(0.1)
    assert b"started 42" in data and host.alive(pid)
    host.stop(pid, grace_s=1.0)
    assert not host.alive(pid)
    assert host.run(f"ps -e -o pgid=,stat= | awk '$1 == {pid} && $2 !~ /^Z/' | wc -l").stdout.strip() == "0"


def test_unknown_host_key_is_refused(rig, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostError, match="unknown host key"):
        ssh(rig, 1, known=str(empty)).run("true")
    assert ssh(rig, 1, known=str(empty), trust_unknown_hosts=True).run("echo ok").stdout.strip() == "ok"


def test_unreachable_host_is_named(rig):
    target = SshTarget("127.0.0.9", "root", 1, rig["key"], rig["known"], connect_timeout=2)
    with pytest.raises(HostError, match=r"root@127\.0\.0\.9:1: unreachable"):
        SshHost(target).run("true")


def test_no_key_file_uses_the_ssh_agent(rig, tmp_path, monkeypatch):
    """`key_file` unset: the agent and the default keys, as `ssh` does (fabric used to get
    key_filename=None and fail with a TypeError)."""
    import os
    import subprocess

    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        while not sock.exists():
            assert agent.poll() is None, "ssh-agent exited"
            time.sleep(0.05)
        subprocess.run(["ssh-add", rig["key"]], env={**os.environ, "SSH_AUTH_SOCK": str(sock)}, check=True,
                       capture_output=True)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        monkeypatch.setenv("HOME", str(tmp_path))  # no default keys: only the agent can log in
        h = rig["hosts"][0]
        host = SshHost(SshTarget(h.address, "root", h.port, None, rig["known"]))
        try:
            assert host.run("echo ok").stdout.strip() == "ok"
        finally:
            host.close()
    finally:
        agent.kill()
        agent.wait()


def test_one_look_gives_states_then_files_in_one_round_trip(host, tmp_path):
    """`survey`: each group's state as `poll` gives it, then each file from its offset; a process seen
    exited has its last lines in the same answer. Over SSH it is one command, however many it asks."""
    log, other = str(tmp_path / "logs" / "p.log"), str(tmp_path / "logs" / "q.log")
    pid = host.start(["sh", "-c", "echo first; sleep 300"], log)  # runs until its group is stopped
    done = host.start(["sh", "-c", "echo only; exit 7"], other)
    while host.poll(done, other) is None or not host.read_log(log)[0]:
        time.sleep(0.05)
    calls = []
    if isinstance(host, SshHost):
        run = host.run
        host.run = lambda command, **kw: calls.append(command) or run(command, **kw)
    states, data = host.survey([(pid, log), (done, other)], [(log, 0), (log, 2), (other, 0), (log, 10**6)])
    assert states == [None, 7]
    assert data == [b"first\n", b"rst\n", b"only\n", b""]
    assert len(calls) == (1 if isinstance(host, SshHost) else 0)
    host.stop(pid, grace_s=1.0)
    assert host.survey([(pid, log)], [])[0] != [None]
