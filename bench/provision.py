"""Provision and start N simulated hosts (real sshd each, own loopback address), cold and warm.

    .venv/bin/python bench/provision.py [--hosts 2 4 8]

Phases, as `prl run` does them for a [cluster] recipe:
  check     ssh + python + disk on every host (parallel, as `prl doctor`)
  wheel     build the project wheel once on the workstation (serial, once per run)
  provision copy the wheel and build the venv on every host (parallel); warm = marker check only
  stage     copy each host its run files: model folder, configs, secret (parallel)
  start     start one process per host that imports the inference stack, wait for all (parallel)
Cold = empty work directories; warm = the same hosts again with an unchanged wheel; serial = warm
again with one host at a time (the parallel steps' speed-up is warm serial / warm).
All simulated hosts share this machine's CPUs, so CPU-bound steps (importing torch in `check` and
`start`, pip in `provision`) cannot overlap beyond the core count here; real hosts each have their own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from sshd_rig import keygen, start_sshd  # noqa: E402

from prl.launch.cluster import stage  # noqa: E402
from prl.launch.doctor import basic_checks, connect  # noqa: E402
from prl.launch.provision import build_wheel, provision_host, wheel_key  # noqa: E402
from prl.model.tiny import write_model_dir  # noqa: E402
from prl.recipe.schema import ClusterCfg, ModelCfg  # noqa: E402


def timed(f):
    t0 = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t0


def one_round(cluster: ClusterCfg, run_dir: Path, pool) -> dict[str, float]:
    hosts = {h.id: connect(cluster, h) for h in cluster.hosts}
    by_id = cluster.hosts_by_id()
    times = {}
    _, times["check"] = timed(lambda: list(pool.map(lambda i: basic_checks(hosts[i], by_id[i], cluster), hosts)))
    with tempfile.TemporaryDirectory() as tmp:
        wheel, times["wheel"] = timed(lambda: build_wheel(Path(tmp)))
        key = wheel_key(wheel, [])
        done, times["provision"] = timed(lambda: list(pool.map(
            lambda i: provision_host(hosts[i], cluster, by_id[i], wheel, key), hosts)))
    remote = {i: f"{cluster.workdir_of(by_id[i])}/runs/bench" for i in hosts}
    _, times["stage"] = timed(lambda: list(pool.map(lambda i: stage(hosts[i], run_dir, remote[i], []), hosts)))

    def start(i: str) -> None:
        python = done[list(hosts).index(i)].python
        r = hosts[i].run(f"cd /tmp && {python} -c 'import prl.inference.server, prl.trainer.trainer'", timeout=300)
        assert r.code == 0, r.stderr

    _, times["start"] = timed(lambda: list(pool.map(start, hosts)))
    times["states"] = sorted({p.state for p in done})
    for h in hosts.values():
        h.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="prl-bench-prov-"))
    run_dir = root / "run"
    write_model_dir(ModelCfg(), run_dir / "model")
    (run_dir / "recipe.json").write_text("{}")
    (run_dir / "secret").write_text("bench")
    key = keygen(root / "client_key")
    rig = [start_sshd(root / f"h{i}", f"127.0.0.{i + 2}", root / "client_key.pub") for i in range(max(args.hosts))]
    known = root / "known_hosts"
    known.write_text("".join(h.known_hosts_line() + "\n" for h in rig))
    rows = []
    try:
        for n in args.hosts:
            hosts = [{"name": f"h{i}", "address": h.address, "port": h.port, "key_file": str(key),
                      "workdir": str(root / f"work{n}" / f"h{i}")} for i, h in enumerate(rig[:n])]
            cluster = ClusterCfg(hosts=hosts, python=sys.executable, known_hosts=str(known))
            with ThreadPoolExecutor(max(4, n)) as pool, ThreadPoolExecutor(1) as one:
                for label, p in (("cold", pool), ("warm", pool), ("serial", one)):  # serial: warm, one host at a time
                    t = one_round(cluster, run_dir, p)
                    total = sum(v for k, v in t.items() if k != "states")
                    rows.append((n, label, t, total))
                    print(f"N={n} {label:<4} total {total:6.2f}s  " + "  ".join(
                        f"{k} {v:5.2f}s" for k, v in t.items() if k != "states") + f"  ({t['states']})", flush=True)
    finally:
        for h in rig:
            h.proc.terminate()
        shutil.rmtree(root, ignore_errors=True)
    by = {(n, lab): tot for n, lab, _, tot in rows}
    small = min(args.hosts)
    for n in args.hosts:
        print(f"N={n}: cold/warm {by[(n, 'cold')] / by[(n, 'warm')]:.1f}x; warm serial/parallel "
              f"{by[(n, 'serial')] / by[(n, 'warm')]:.2f}x; cold vs N={small}: "
              f"{by[(n, 'cold')] / by[(small, 'cold')]:.2f}x time for {n / small:.0f}x hosts")
    big = max(args.hosts)
    print(json.dumps({**{f"total_s_n{n}_{lab}": round(t, 2) for (n, lab), t in by.items()},
                      f"cold_over_warm_n{big}": round(by[(big, "cold")] / by[(big, "warm")], 2),
                      f"serial_over_parallel_n{big}": round(by[(big, "serial")] / by[(big, "warm")], 2)}))


if __name__ == "__main__":
    main()
