"""Multi-host runs against real sshd hosts (the `rig`: host a and host b, each in its own network
namespace where this machine allows it, else on its own loopback address).

Each host has its own work directory and the workstation its own run directory: nothing is
shared, so batches and weights must travel over the network. Also the 28-host plan (dry run)."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, import_or_skip, prl_cmd
from sshd_rig import IFNAME, host_port
from vllm_rig import needs_vllm

pytestmark = pytest.mark.slow
QUICK = ["--set", "sft.steps=5", "--set", "trainer.checkpoint_every=0"]


def two_host_recipe(tmp_path: Path, rig, steps: int, trainer: str = "['a']", orchestrator: str = "a",
                    base: str = "reverse-tiny.toml") -> Path:
    a, b = rig["hosts"]
    text = (ROOT / "recipes" / base).read_text()
    text = text.replace("[run]\n", f"[run]\noutput_dir = '{tmp_path}/workstation'\n")
    text += "\n".join([
        "[cluster]", f"python = '{sys.executable}'", f"known_hosts = '{rig['known']}'", "min_free_gb = 0.01",
        f"rendezvous_port = {host_port(a)}", f"trainer_port = {host_port(a)}", f"inference_port = {host_port(b)}",
        "[[cluster.hosts]]", "name = 'a'", f"address = '{a.address}'", f"port = {a.port}",
        f"key_file = '{rig['key']}'", f"workdir = '{tmp_path}/host_a'",
        "[[cluster.hosts]]", "name = 'b'", f"address = '{b.address}'", f"port = {b.port}",
        f"key_file = '{rig['key']}'", f"workdir = '{tmp_path}/host_b'",
        "[placement]", f"trainer = {trainer}", "inference = ['b']", f"orchestrator = '{orchestrator}'",
    ]) + "\n"
    if rig["netns"]:  # gloo must use the namespace's interface: the hostname resolves to loopback here
        text = text.replace("[cluster]\n", f"[cluster]\nenv = {{ GLOO_SOCKET_IFNAME = '{IFNAME}' }}\n")
    text = re.sub(r"max_steps = \d+", f"max_steps = {steps}", text)
    path = tmp_path / "two-hosts.toml"
    path.write_text(text)
    return path


def events(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]


def leftovers(tmp_path: Path) -> str:
    """Processes of this test's hosts still running (their command lines name the host workdirs)."""
    p = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True)
    return "\n".join(ln for ln in p.stdout.splitlines() if f"{tmp_path}/host_" in ln and "ps -eo" not in ln)


def test_two_host_run_without_shared_storage_and_resume(rig, tmp_path):
    """The orchestrator on a, the server on b, one torchrun per trainer host (--nnodes 2, rendezvous on
    a; rank 0 scatters each step's micro-batches to rank 1 on b over gloo). Without a shared folder only
    a holds checkpoints (rank 0 gathers them whole); the resumed run's rank 0 reads one and broadcasts."""
    a, b = rig["hosts"]
    recipe = two_host_recipe(tmp_path, rig, steps=4, trainer="['a', 'b']")  # step 3 needs v2 served
    p = subprocess.run(prl_cmd("run", recipe, "--no-tui", *QUICK), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    ws = tmp_path / "workstation" / "reverse-tiny"
    host_a, host_b = tmp_path / "host_a" / "runs" / "reverse-tiny", tmp_path / "host_b" / "runs" / "reverse-tiny"
    metrics = ws / "metrics.jsonl"
    assert [e["step"] for e in events(metrics, "orch_step")] == [0, 1, 2, 3]
    assert [e["step"] for e in events(metrics, "trainer_step") if e["stage"] == "rl"] == [0, 1, 2, 3]
    procs = {e["name"]: e["host"] for e in events(metrics, "process") if "host" in e}
    assert procs == {"inference-0": "b", "orchestrator": "a", "trainer-0": "a", "trainer-1": "b"}
    # the served policy advanced on b, from b's own verified copies of the weights
    served = [e["version"] for e in events(metrics, "weights")]  # relayed: b answered "loaded vN"
    assert served == sorted(served) and served[0] == 0 and served[-1] >= 2, served
    assert {e["name"] for e in events(metrics, "server")} == {"inference-0"}
    assert sorted(int(d.name[1:]) for d in (host_b / "weights").glob("v*"))[-1] >= 2
    assert not (host_b / "checkpoints").exists() and (host_a / "checkpoints").exists()
    assert json.loads((host_a / "checkpoints" / "step_4" / "MANIFEST.json").read_text())["format"] == "full"
    # logs streamed back to the workstation
    for name in ("trainer-0", "trainer-1", "orchestrator", "inference-0"):
        assert (ws / "logs" / f"{name}.log").stat().st_size > 0
    assert "rank 1 of 2" in (ws / "logs" / "trainer-1.log").read_text()
    assert f"serving on http://{b.address}" in (ws / "logs" / "inference-0.log").read_text()
    assert not leftovers(tmp_path), leftovers(tmp_path)
    status = subprocess.run(prl_cmd("status", ws), capture_output=True, text=True, timeout=60,
                            env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})
    assert status.returncode == 0 and "inference-0" in status.stdout and "done" in status.stdout
    # resume: rank 0 on a reads its checkpoint; b refetches the republished weights
    before = len(events(metrics, "orch_step"))
    p = subprocess.run(prl_cmd("run", "--resume", ws, "--no-tui", "--set", "rl.max_steps=6"), capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    assert [e["step"] for e in events(metrics, "orch_step")[before:]] == [4, 5]
    assert events(metrics, "resumed")[-1]["step"] == 4
    assert not leftovers(tmp_path), leftovers(tmp_path)


@needs_vllm
def test_vllm_server_on_another_host(rig, tmp_path):
    """inference.backend = "vllm" over SSH: the vLLM server runs on b (bound to b's address, started by
    prl's launcher over the same Host layer), and prl's weight-transfer engine inside vLLM's worker
    downloads and verifies every version from the trainer endpoint on a; nothing is left on either host."""
    from test_run import group_members

    a, b = rig["hosts"]
    recipe = two_host_recipe(tmp_path, rig, steps=3, base="reverse-tiny-vllm.toml")
    p = subprocess.run(prl_cmd("run", recipe, "--no-tui", *QUICK), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    ws = tmp_path / "workstation" / "reverse-tiny-vllm"
    metrics = ws / "metrics.jsonl"
    assert [e["step"] for e in events(metrics, "trainer_step") if e["stage"] == "rl"] == [0, 1, 2]
    procs = {e["name"]: (e["host"], e.get("pid")) for e in events(metrics, "process") if "host" in e}
    assert procs["inference-0"][0] == "b"
    served = [e["version"] for e in events(metrics, "weights")]
    assert served == sorted(served) and served[0] == 0 and served[-1] >= 1, served
    host_b = tmp_path / "host_b" / "runs" / "reverse-tiny-vllm"
    assert sorted(int(d.name[1:]) for d in (host_b / "weights").glob("v*"))[-1] >= 1, "b fetched its own copies"
    log = (ws / "logs" / "inference-0.log").read_text()
    assert "vllm.entrypoints.openai.api_server" in log and f"--host {b.address}" in log
    assert not leftovers(tmp_path), leftovers(tmp_path)
    assert not any(group_members(pid) for _, pid in procs.values() if pid), "vLLM's engine processes left"


def test_trainer_across_two_hosts_orchestrated_from_the_workstation_shares_its_checkpoints(rig, tmp_path):
    """One torchrun per trainer host, the orchestrator on the workstation (it reaches a and b over the
    network). With `cluster.shared_checkpoints` both ranks write their shards there, and a resumed run
    reads them. (Without one: `test_two_host_run_without_shared_storage_and_resume`.)"""
    recipe = two_host_recipe(tmp_path, rig, steps=3, trainer="['a', 'b']", orchestrator="workstation")
    recipe.write_text(recipe.read_text().replace("[cluster]\n", f"[cluster]\nshared_checkpoints = '{tmp_path}/nfs'\n"))
    p = subprocess.run(prl_cmd("run", recipe, "--no-tui", *QUICK), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    ws = tmp_path / "workstation" / "reverse-tiny"
    procs = {e["name"]: e["host"] for e in events(ws / "metrics.jsonl", "process") if "host" in e}
    assert procs == {"inference-0": "b", "orchestrator": "workstation", "trainer-0": "a", "trainer-1": "b"}
    rl = [e for e in events(ws / "metrics.jsonl", "trainer_step") if e["stage"] == "rl"]
    assert [e["step"] for e in rl] == [0, 1, 2]
    assert "rank 1 of 2" in (ws / "logs" / "trainer-1.log").read_text()  # streamed back from b
    host_a, host_b = (tmp_path / f"host_{h}" / "runs" / "reverse-tiny" / "checkpoints" for h in "ab")
    assert not leftovers(tmp_path), leftovers(tmp_path)
    folder = tmp_path / "nfs" / "reverse-tiny"
    assert host_a.resolve() == host_b.resolve() == folder.resolve()
    assert json.loads((folder / "step_3" / "MANIFEST.json").read_text())["format"] == "dcp"
    assert sorted(f.name for f in (folder / "step_3").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    p = subprocess.run(prl_cmd("run", "--resume", ws, "--no-tui", "--set", "rl.max_steps=4"), capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    assert events(ws / "metrics.jsonl", "resumed")[-1]["step"] == 3
    assert [e["step"] for e in events(ws / "metrics.jsonl", "trainer_step") if e["stage"] == "rl"][-1] == 3
    assert not leftovers(tmp_path), leftovers(tmp_path)


def test_kv_pool_master_on_one_host_serves_a_server_on_another(rig, tmp_path):
    """`inference.kv_pool` on a cluster: the kv-master runs on host a (kv_pool.host), the server on b
    joins it over the network and puts its prompt chunks there; teardown stops the master too."""
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    a, b = rig["hosts"]
    recipe = two_host_recipe(tmp_path, rig, steps=2)
    recipe.write_text(recipe.read_text() + "[inference.kv_pool]\nenabled = true\nhost = 'a'\nchunk_tokens = 4\n"
                      "memory_gb = 0.05\n")
    p = subprocess.run(prl_cmd("run", recipe, "--no-tui", *QUICK), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    ws = tmp_path / "workstation" / "reverse-tiny"
    procs = {e["name"]: e["host"] for e in events(ws / "metrics.jsonl", "process") if "host" in e}
    assert procs["kv-master"] == "a" and procs["inference-0"] == "b"
    assert f"joined the KV pool at {a.address}:50051" in (ws / "logs" / "inference-0.log").read_text()
    assert events(ws / "metrics.jsonl", "server")[-1]["pool_stored_chunks"] > 0
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--rpc_address={a.address}" not in ps, "the master was left running"
    assert not leftovers(tmp_path), leftovers(tmp_path)


def start_long_run(tmp_path: Path, rig, heartbeat_s: int = 60) -> subprocess.Popen:
    """A 500-step two-host run in the background, returned once its first RL step is done."""
    recipe = two_host_recipe(tmp_path, rig, steps=500)
    recipe.write_text(recipe.read_text().replace("[cluster]\n", f"[cluster]\nheartbeat_timeout_s = {heartbeat_s}\n"))
    proc = subprocess.Popen(prl_cmd("run", recipe, "--no-tui", *QUICK), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "workstation" / "reverse-tiny" / "metrics.jsonl"
    deadline = time.time() + 300
    while not any(e["stage"] == "rl" for e in events(metrics, "trainer_step")):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.5)
    return proc


def rl_steps(tmp_path: Path) -> int:
    metrics = tmp_path / "workstation" / "reverse-tiny" / "metrics.jsonl"
    return sum(e["stage"] == "rl" for e in events(metrics, "trainer_step"))


def test_ssh_hiccup_and_a_killed_server_on_b_are_survived_then_ctrl_c_stops_every_host(rig, tmp_path):
    """One long run, three faults in turn. Killing the driver's SSH sessions to b mid-run neither stops
    b's processes nor the run (the driver reconnects, nothing is restarted). SIGKILL of the server on
    b: the driver restarts it on b over SSH, it rejoins with the served weights and the run goes on.
    Then Ctrl-C stops everything on both hosts."""
    proc = start_long_run(tmp_path, rig)
    metrics = tmp_path / "workstation" / "reverse-tiny" / "metrics.jsonl"
    # the SSH hiccup
    listener = str(rig["hosts"][1].proc.pid)
    ps = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.split("\n")[1:]
    sessions = [ln.split()[0] for ln in ps if ln.split() and ln.split()[1] == listener]
    assert sessions
    subprocess.run(["kill", "-9", *sessions], check=True)
    done, deadline = rl_steps(tmp_path), time.time() + 300
    while rl_steps(tmp_path) < done + 2:
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.5)
    assert leftovers(tmp_path)
    assert not events(metrics, "restart"), f"the SSH hiccup restarted a process: {events(metrics, 'restart')}"
    # the server on b killed
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    pids = [ln.split()[0] for ln in ps  # the server's python, not the `sh` that records its exit status
            if f"-m prl.inference --config {tmp_path}/host_b" in ln and ln.split()[1] != "sh"]
    assert len(pids) == 1, ps
    def ups() -> int:
        return sum(e["name"] == "inference-0" and e["state"] == "up" for e in events(metrics, "server_state"))
    before = ups()
    subprocess.run(["kill", "-9", *pids], check=True)
    while ups() == before:  # it rejoined
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.5)
    done = rl_steps(tmp_path)
    while rl_steps(tmp_path) < done + 2:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.5)
    [restart] = events(metrics, "restart")
    assert restart["name"] == "inference-0" and "killed by SIGKILL" in restart["cause"], restart
    # Ctrl-C
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)  # only how long the test waits before failing
    assert proc.returncode == 130 and "interrupted" in out, out[-3000:]
    assert not leftovers(tmp_path), leftovers(tmp_path)


def test_remote_processes_stop_when_the_driver_dies(rig, tmp_path):
    """SIGKILL the driver (no teardown possible): the watchdogs on a and b see no heartbeat and stop
    their process groups; `prl status` says the driver is gone."""
    proc = start_long_run(tmp_path, rig, heartbeat_s=10)
    ws = tmp_path / "workstation" / "reverse-tiny"
    assert leftovers(tmp_path)
    proc.kill()
    proc.wait()
    status = subprocess.run(prl_cmd("status", ws), capture_output=True, text=True, timeout=60,
                            env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})
    assert "driver gone" in status.stdout, status.stdout
    deadline = time.time() + 120  # the watchdogs' 10 s heartbeat, on a busy machine
    while leftovers(tmp_path) and time.time() < deadline:
        time.sleep(1)
    assert not leftovers(tmp_path), leftovers(tmp_path)
    log = (tmp_path / "host_b" / "runs" / "reverse-tiny" / "logs" / "inference-0.log").read_text()
    assert "no heartbeat from the driver for 10s" in log


def test_unreachable_host_stops_the_run_before_anything_starts(rig, tmp_path):
    recipe = two_host_recipe(tmp_path, rig, steps=3)
    b = rig["hosts"][1]
    text = recipe.read_text()
    assert f"address = '{b.address}'\nport = {b.port}\n" in text
    recipe.write_text(text.replace(f"address = '{b.address}'\nport = {b.port}\n", "address = '127.0.0.9'\nport = 1\n"))
    p = subprocess.run(prl_cmd("run", recipe, "--no-tui"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "b: reachable:" in p.stdout and "unreachable" in p.stdout
    assert not (tmp_path / "host_a" / "runs").exists() and not leftovers(tmp_path)


def test_28_host_plan():
    p = subprocess.run(prl_cmd("run", ROOT / "recipes" / "glm5-131k-28xh200.toml", "--dry-run"),
                       capture_output=True, text=True, timeout=60, env={"COLUMNS": "400", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    plan = p.stdout[p.stdout.index("process plan:"):]
    assert "process plan: 41 processes on 28 host(s)" in plan
    hosts = set(re.findall(r"host=(h\d\d)", plan))
    assert hosts == {f"h{i:02d}" for i in range(28)}
    ranks = re.findall(r"--nnodes=16 --node-rank=(\d+) --master-addr=10\.0\.0\.11 --master-port=29500", plan)
    assert sorted(map(int, ranks)) == list(range(16))
    # one vLLM engine over the 12 inference hosts: the leader (API server) on h16, headless workers on the rest
    assert re.findall(r"inference-0 +role=inference +host=(h\d\d)", plan) == ["h16"]
    workers = re.findall(r"inference-0-host(\d+) role=engine_worker +host=(h\d\d)", plan)
    assert workers == [(str(k), f"h{16 + k}") for k in range(1, 12)]
    sandboxes = re.findall(r"sandbox-(\d+) +role=sandbox +host=(h\d\d)", plan)  # one per inference host
    assert [h for _, h in sandboxes] == [f"h{i}" for i in range(16, 28)]
    assert plan.count("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7") == 12
    assert re.search(r"orchestrator +role=orchestrator +host=h00", plan)
    assert "weights: all 128 trainer ranks -> 1 inference server(s) on 12 host(s), streamed (NCCL" in plan
    common = ("--enable-expert-parallel", "--enable-return-routed-experts", '--weight-transfer-config \'{"backend":"prl"}\'',
              "--logprobs-mode processed_logprobs", "--data-parallel-size 96 --data-parallel-size-local 8 "
              "--data-parallel-address 10.0.0.27 --data-parallel-rpc-port 13345")
    leader = re.findall(r"-m vllm\.entrypoints\.openai\.api_server (.*)", plan)
    headless = re.findall(r"-m prl\.backends\.vllm\.headless (.*)", plan)
    assert len(leader) == 1 and len(headless) == 11
    assert all(part in line for line in leader + headless for part in common)
    assert "--port 8000" in leader[0] and "--headless" not in leader[0]
    starts = [int(re.search(r"--headless --data-parallel-start-rank (\d+)", line).group(1)) for line in headless]
    assert starts == [8 * k for k in range(1, 12)]


@pytest.mark.parametrize("extra, words", [
    ("[placement]\ntrainer = ['a']\ninference = ['zz']\n", ["placement.inference", "zz"]),
    ("[inference]\nnum_servers = 2\n", ["inference.num_servers", "not used with [cluster]"]),
    ("[trainer]\nnproc = 16\n", ["trainer.nproc (16)", "8 GPUs"]),
    ("[placement]\ntrainer = ['a']\ninference = ['a']\nsandbox = ['q']\n", ["placement.sandbox", "q"]),
])
def test_placement_errors_name_the_key(tmp_path, extra, words):
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster]\n[[cluster.hosts]]\naddress = '10.0.0.1'\nname = 'a'\ngpus = 8\n" + extra)
    p = subprocess.run(prl_cmd("run", bad, "--dry-run"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and all(w in p.stderr for w in words), p.stderr


@pytest.mark.parametrize("resume", [False, True])
def test_staging_links_checkpoints_to_the_shared_folder(tmp_path, resume):
    """A trainer host's `checkpoints` becomes a link to the shared folder. A resumed run whose
    `checkpoints` is still a folder of its own (shared checkpoints turned on for the resume) moves
    its checkpoints into the shared folder first, instead of linking inside it; a new run empties it."""
    from prl.launch.cluster import link_checkpoints
    from prl.launch.hosts import LocalHost

    local, shared = tmp_path / "work" / "checkpoints", tmp_path / "shared" / "run"
    local.parent.mkdir()
    if resume:  # a new run's work folder was emptied by `stage` before this
        for step, text in (("step_0", "local"), ("step_2", "{}")):
            (local / step).mkdir(parents=True)
            (local / step / "MANIFEST.json").write_text(text)
    (shared / "step_0").mkdir(parents=True)
    (shared / "step_0" / "MANIFEST.json").write_text("shared")
    r = LocalHost().run(link_checkpoints(str(local), str(shared), resume))
    assert r.code == 0, r.stderr
    assert local.is_symlink() and local.resolve() == shared.resolve()
    assert sorted(p.name for p in shared.iterdir()) == (["step_0", "step_2"] if resume else [])
    if resume:
        assert (shared / "step_0" / "MANIFEST.json").read_text() == "shared", "a step the shared folder has is kept"
        assert (shared / "step_2" / "MANIFEST.json").read_text() == "{}"
    r = LocalHost().run(link_checkpoints(str(local), str(shared), True))  # again: the link stays one link
    assert r.code == 0 and local.is_symlink() and not (shared / "run").exists(), r.stderr


@pytest.mark.parametrize("sandbox_hosts", [None, ["c"]])
def test_sandbox_workers_run_on_the_inference_hosts_or_where_placement_says(tmp_path, sandbox_hosts):
    """`env.kind = "code"`: one sandbox worker per sandbox host (default: the inference hosts), each
    a port to keep free, a connection from the orchestrator, and a sandbox that doctor tries there."""
    from prl.launch.doctor import role_needs
    from prl.launch.placement import links_needed, ports_needed
    from prl.launch.configs import resolve
    from prl.recipe.schema import Recipe

    hosts = [{"address": f"10.0.0.{i}", "name": n} for i, n in enumerate("abc", 1)]
    placement = {"trainer": ["a"], "inference": ["b"], **({"sandbox": sandbox_hosts} if sandbox_hosts else {})}
    recipe = Recipe.model_validate({"cluster": {"hosts": hosts, "sandbox_port": 8901}, "placement": placement,
                                    "env": {"kind": "code", "max_total_tokens": 64}})
    configs = resolve(recipe, tmp_path)
    where = sandbox_hosts or ["b"]
    workers = [c for c in configs if c.role == "sandbox"]
    assert [(w.node, w.host, w.port) for w in workers] == [(n, f"10.0.0.{'abc'.index(n) + 1}", 8901) for n in where]
    orch = next(c for c in configs if c.role == "orchestrator")
    assert orch.sandboxes == [f"http://{w.host}:{w.port}" for w in workers] and orch.node == "a"
    assert all(8901 in ports_needed(configs, recipe)[n] for n in where)
    assert {(ln.src, ln.dst, ln.port) for ln in links_needed(configs, recipe)} >= {("a", n, 8901) for n in where}
    assert {h for h, needs in role_needs(recipe).items() if "sandbox:namespaces" in needs} == set(where)
