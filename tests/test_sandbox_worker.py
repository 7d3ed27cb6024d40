"""The `sandbox` run role: real worker processes (`python -m prl.sandbox --config`) on loopback and the
orchestrator's client (`prl.sandbox.client.SandboxClient`)."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prl.launch.configs import resolve
from prl.recipe.resolve import write_configs, write_secret
from prl.recipe.schema import Recipe
from prl.sandbox.client import SandboxClient
from prl.transport import ports

UID_BASE = int(os.environ.get("PRL_SANDBOX_UID_BASE", 1900000000))


def start_worker(cfg, path: Path) -> subprocess.Popen:
    log = open(Path(cfg.run_dir) / f"{cfg.name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "prl.sandbox", "--config", str(path)], stdout=log,
                            stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, cfg) -> str:
    """The worker's URL once it answers /health (a worker that dies while starting fails at once)."""
    auth = {"Authorization": f"Bearer {cfg.secret()}"}
    while True:
        assert proc.poll() is None, (Path(cfg.run_dir) / f"{cfg.name}.log").read_text()
        url = ports.url_of(cfg.run_dir, cfg.name, "")
        try:
            if url and httpx.get(f"{url}/health", headers=auth).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.1)


@pytest.fixture
def workers(tmp_path):
    recipe = Recipe.model_validate({"env": {"kind": "code", "max_total_tokens": 64, "sandbox": {"workers": 2, "concurrency": 1,
                                                                         "timeout_s": 20}}})
    configs = resolve(recipe, tmp_path, write_secret(tmp_path))
    paths = write_configs(configs, tmp_path)
    cfgs = [c for c in configs if c.role == "sandbox"]
    procs = [start_worker(c, paths[c.name]) for c in cfgs]
    urls = [wait_ready(p, c) for p, c in zip(procs, cfgs)]
    client = lambda: SandboxClient(urls, cfgs[0].secret(), 1, 20, unavailable_s=60,  # noqa: E731
                                   locate=lambda i, u: ports.url_of(tmp_path, f"sandbox-{i}", u))
    yield {"procs": procs, "cfgs": cfgs, "paths": paths, "urls": urls, "client": client}
    for p in procs:
        p.kill()
        p.wait()


def sandbox_pids() -> list[int]:
    """Processes running as one of the sandbox's execution uids."""
    out = []
    for d in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            uid = int(next(ln for ln in open(f"/proc/{d}/status") if ln.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if UID_BASE <= uid < UID_BASE + 4096:
            out.append(int(d))
    return out


def test_workers_run_programs_spread_them_and_refuse_bad_requests(workers):
    async def go():
        client = workers["client"]()
        try:
            r = await client.run("import sys; print(int(sys.stdin.read()) * 7)", stdin="6")
            assert (r.exit_code, r.stdout.strip(), r.isolation) == (0, "42", "namespaces")
            both = await asyncio.gather(*(client.run("import time; time.sleep(1); print('x')") for _ in range(2)))
            assert [b.stdout for b in both] == ["x\n", "x\n"]
            with pytest.raises(ValueError, match="400.*language"):
                await client.run("print(1)", language="cobol")
            health = await client.health()
            # concurrency 1 each: the two sleeps ran on the two workers, one at a time on each
            assert [h["peak_in_flight"] for h in health] == [1, 1] and sum(h["counts"]["executions"] for h in health) == 3
        finally:
            await client.close()

    asyncio.run(go())
    url, secret = workers["urls"][0], workers["cfgs"][0].secret()
    assert httpx.post(f"{url}/run", json={"code": "print(1)"}).status_code == 401
    bad = httpx.post(f"{url}/run", json={"code": "print(1)", "timeout_s": 999},
                     headers={"Authorization": f"Bearer {secret}"})
    assert bad.status_code == 422 and "timeout_s" in bad.text  # a request cannot raise the worker's limits
    assert httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {secret}"}).status_code == 200


def test_a_client_that_goes_away_cancels_its_execution(workers):
    url, auth = workers["urls"][0], {"Authorization": f"Bearer {workers['cfgs'][0].secret()}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/run", json={"code": "import time; time.sleep(60)"}, headers=auth, timeout=2.0)
    while httpx.get(f"{url}/health", headers=auth).json()["counts"].get("killed.cancelled", 0) < 1:
        time.sleep(0.2)
    while sandbox_pids():  # the program's processes went with it
        time.sleep(0.2)


def test_a_worker_killed_mid_execution_leaves_nothing_and_the_program_runs_on_another(workers):
    """SIGKILL of the worker running a program: bubblewrap dies with its parent (nothing of the program
    is left), the client sends the program to the other worker, and a restarted worker is used again."""
    procs, cfgs, urls = workers["procs"], workers["cfgs"], workers["urls"]
    auth = {"Authorization": f"Bearer {cfgs[0].secret()}"}

    async def go():
        client = workers["client"]()
        try:
            client.workers[1].down_until = time.monotonic() + 3600  # the first try goes to worker 0
            run = asyncio.create_task(client.run("import time; time.sleep(5); print('done')"))
            while not (first := sandbox_pids()):
                await asyncio.sleep(0.05)
            client.workers[1].down_until = 0.0
            procs[0].kill()
            while any(os.path.exists(f"/proc/{p}") for p in first):  # bwrap died with its parent
                await asyncio.sleep(0.05)
            result = await run
            assert result.stdout == "done\n"
            health = await asyncio.to_thread(httpx.get, f"{urls[1]}/health", headers=auth)
            assert health.json()["counts"]["executions"] == 1
            procs[0].wait()
            procs[0] = start_worker(cfgs[0], workers["paths"][cfgs[0].name])  # as the driver restarts it
            await asyncio.to_thread(wait_ready, procs[0], cfgs[0])
            client.workers[1].down_until = time.monotonic() + 3600
            assert (await client.run("print(2)")).stdout == "2\n"  # found again, wherever it now listens
        finally:
            await client.close()

    asyncio.run(go())
    while sandbox_pids():
        time.sleep(0.2)


def test_a_hung_worker_is_reported_and_its_program_runs_on_another(workers):
    """A worker that takes a program and never answers (SIGSTOP) is reported hung (the orchestrator
    turns that into an `unresponsive` event, on which the driver restarts it); the program runs elsewhere."""
    procs, urls = workers["procs"], workers["urls"]
    hung = []

    async def go():
        # 5 s for the program on worker 1 (a sandbox's start included, on a busy machine)
        client = SandboxClient(urls, workers["cfgs"][0].secret(), 1, 5.0, unavailable_s=60,
                               on_hang=lambda i, cause: hung.append((i, cause)), slack_s=1.0)
        try:
            client.workers[1].in_flight = 1  # the first try goes to worker 0
            procs[0].send_signal(signal.SIGSTOP)
            result = await client.run("print('elsewhere')")
            assert result.stdout == "elsewhere\n" and hung == [(0, "no answer 6s after it took a program")]
        finally:
            procs[0].send_signal(signal.SIGCONT)
            await client.close()

    asyncio.run(go())
