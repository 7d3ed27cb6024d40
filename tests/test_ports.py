"""Ports that cannot collide (issue 25): distinct within a resolve, a port taken before a role binds
it is not fatal on one machine (the role moves and says where), and a configured port in use on a
cluster host fails before anything starts, naming the host, the port and the process holding it."""

import io
import json
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, import_or_skip, prl_cmd
from prl.recipe import load_recipe
from prl.launch.configs import resolve
from prl.transport import ports


def held(host: str, port: int) -> socket.socket:
    """A listener this test keeps on `host:port` (another process's, as far as prl can tell)."""
    s = socket.socket()
    s.bind((host, port))
    s.listen(1)
    return s


def listening_ports(configs) -> list[tuple[str, int]]:
    out = []
    for c in configs:
        if c.role in ("inference", "trainer"):
            out.append((c.host, c.port))
        if c.role == "kv_master":
            out += [(c.host, c.kv_master[k]) for k in ("rpc_port", "metadata_port", "metrics_port")]
    return out


def test_a_resolve_never_gives_two_roles_one_port(tmp_path, monkeypatch):
    """The OS may hand out the port it just handed out (its probe socket is closed): the resolver
    asks again. Checked with a free-port source that repeats itself, and with the real one many times."""
    recipe = load_recipe(ROOT / "recipes/reverse-tiny.toml",
                         ["inference.num_servers=4", "inference.kv_pool.enabled=true"])
    from prl.recipe import resolve as resolve_module

    real, calls = resolve_module.free_port, []

    def repeating(host="127.0.0.1"):
        calls.append(1)
        return 40000 + (len(calls) // 3)  # each port three times in a row

    monkeypatch.setattr(resolve_module, "free_port", repeating)
    got = [p for _, p in listening_ports(resolve(recipe, tmp_path))]
    assert len(got) == 8 and len(set(got)) == 8, got
    monkeypatch.setattr(resolve_module, "free_port", real)
    for _ in range(300):
        got = [p for _, p in listening_ports(resolve(recipe, tmp_path))]
        assert len(set(got)) == len(got), got


def test_bind_moves_off_a_taken_port_only_when_allowed():
    with held("127.0.0.1", 0) as busy:
        port = busy.getsockname()[1]
        with ports.bind("127.0.0.1", port, fallback=True) as s:
            assert s.getsockname()[1] not in (0, port)
        with pytest.raises(ports.PortTaken) as e:
            ports.bind("127.0.0.1", port, fallback=False)
        assert f"127.0.0.1:{port} is already in use by pid" in str(e.value)
        moved = ports.pick("127.0.0.1", [port, port])
        assert port not in moved and len(set(moved)) == 2


def test_vllm_launcher_moves_off_a_taken_port_and_publishes_it(tmp_path):
    """vLLM binds the port on its command line itself: the launcher probes it first and rewrites
    `--port` when it is taken (the orchestrator reads the published one)."""
    from prl.backends.vllm.launch import launch_command, settle_port

    recipe = load_recipe(ROOT / "recipes/reverse-tiny-vllm.toml")
    cfg = next(c for c in resolve(recipe, tmp_path) if c.role == "inference")
    command = launch_command(cfg, "python")[launch_command(cfg, "python").index("--") + 1:]
    with held(cfg.host, cfg.port):
        moved = settle_port(cfg, command)
    got = int(moved[moved.index("--port") + 1])
    assert got != cfg.port and moved[:moved.index("--port")] == command[:command.index("--port")]
    assert ports.lookup(tmp_path, cfg.name) == (cfg.host, [got])
    assert ports.url_of(tmp_path, cfg.name, "default") == f"http://{cfg.host}:{got}"


@pytest.mark.slow
def test_a_local_run_survives_ports_taken_between_resolve_and_bind(tmp_path):
    """Every port the resolver chose (server, trainer endpoint, the KV pool's master) is taken by
    another process before the run starts: the run trains to the end without a restart, each role
    on a port of its own that it published."""
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    from rich.console import Console

    from prl.launch.driver import prepare_new, supervise
    from prl.launch.hosts import LocalHost
    from prl.launch.processes import make_plan
    from prl.launch.supervisor import Supervisor
    from prl.recipe.resolve import write_configs, write_secret

    recipe = load_recipe(ROOT / "recipes/reverse-tiny.toml", [
        f"run.output_dir='{tmp_path}'", "sft.steps=2", "rl.max_steps=3", "rl.batch_size=16",
        "inference.kv_pool.enabled=true", "inference.kv_pool.memory_gb=0.05"])
    run_dir = tmp_path / recipe.run.name
    prepare_new(recipe, run_dir, force=True)
    configs = resolve(recipe, run_dir, write_secret(run_dir))
    write_configs(configs, run_dir)
    taken = listening_ports(configs)
    holders = [held(h, p) for h, p in taken]
    try:
        sup = Supervisor(make_plan(configs, run_dir), {"local": LocalHost()}, run_dir)
        try:
            outcome = supervise(sup, recipe, run_dir, Console(file=io.StringIO()), tui=False)
        finally:
            sup.close()
    finally:
        for s in holders:
            s.close()
    log = (run_dir / "metrics.jsonl").read_text()
    assert outcome.code == 0, outcome.message
    assert '"kind": "restart"' not in log.replace('"kind":"restart"', '"kind": "restart"')
    published = {name: ports.lookup(run_dir, name) for name in ("inference-0", "trainer", "kv-master")}
    assert all(published.values()), published
    assert not {p for _, got in published.values() for p in got} & {p for _, p in taken}, (published, taken)
    steps = [json.loads(line) for line in log.splitlines() if '"trainer_step"' in line]
    assert any(e.get("stage") == "rl" and e["step"] == 2 for e in steps)


@pytest.mark.slow
def test_a_cluster_port_in_use_fails_before_start_naming_host_port_and_holder(rig, tmp_path):
    """On a cluster ports are configured: the trainer endpoint's port held on host a stops `prl run`
    before anything starts, naming a's address, the port and the process that holds it."""
    import re

    from test_cluster import leftovers, two_host_recipe

    a = rig["hosts"][0]
    recipe = two_host_recipe(tmp_path, rig, steps=2)
    port = int(re.search(r"trainer_port = (\d+)", recipe.read_text()).group(1))
    code = (f"import socket, time\ns = socket.socket(); s.bind(({a.address!r}, {port})); s.listen(1)\n"
            "print('ready', flush=True); time.sleep(600)")
    cmd = [sys.executable, "-c", code]
    holder = subprocess.Popen(["ip", "netns", "exec", a.netns, *cmd] if a.netns else cmd, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        p = subprocess.run(prl_cmd("run", recipe, "--no-tui"), capture_output=True, text=True, timeout=300,
                           env={"COLUMNS": "300", "PATH": "/usr/bin:/bin:/usr/sbin"})
    finally:
        holder.kill()
        holder.wait()
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert f"{a.address}:{port} by pid {holder.pid}" in out, out
    assert "nothing was started" in out, out
    assert not (tmp_path / "host_a" / "runs").exists() and not leftovers(tmp_path)
