"""The run's `mooncake_master` (the KV pool's master and its HTTP metadata server), a process prl
starts, supervises and stops like any other (`[inference.kv_pool]`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class MasterAddress:
    host: str
    rpc_port: int
    metadata_port: int
    metrics_port: int

    @property
    def master(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def health(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/health"


def master_command(addr: MasterAddress, python: str = sys.executable, disk: str | None = None,
                   disk_gb: float = 0.0) -> list[str]:
    """`mooncake_master` through the package's own launcher (`python -m mooncake.cli`), which execs
    the packaged binary: the pid prl supervises is the master's, and any interpreter that imports
    `mooncake` (a host's layered venv too) finds it. `disk`: the pool's disk tier, a folder every
    pool member sees (each put is also written there as a file, and a chunk evicted from memory is
    read back from it by any server)."""
    master = [python, "-m", "mooncake.cli", f"--rpc_address={addr.host}", f"--rpc_port={addr.rpc_port}",
              "--enable_http_metadata_server=true", f"--http_metadata_server_host={addr.host}",
              f"--http_metadata_server_port={addr.metadata_port}", f"--metrics_host={addr.host}",
              f"--metrics_port={addr.metrics_port}", "--eviction_high_watermark_ratio=0.9", "--eviction_ratio=0.05",
              "--client_ttl=10",
              # a read leases its object this long (default 10 s): leased objects are not evicted, so a
              # full pool refused puts for 10 s after each read
              "--default_kv_lease_ttl=1000"]
    if disk:
        master += [f"--root_fs_dir={disk}"] + ([f"--global_file_segment_size={int(disk_gb * 2**30)}"] if disk_gb else [])
    return master


def launch_command(cfg, python: str) -> list[str]:
    """The `kv-master` role: `python -m prl.inference.kv_master --config CFG`, which settles the ports
    and the disk tier, then execs `mooncake_master` (same pid)."""
    return [python, "-m", "prl.inference.kv_master", "--config", cfg.config_path]


def address(cfg) -> MasterAddress:
    """Where the run's master listens: as published on this machine (its ports may have moved off
    taken ones, `prl.transport.ports`), else as configured."""
    from prl.transport import ports

    found = ports.lookup(cfg.run_dir, "kv-master")  # published only by a master that picks its ports
    return MasterAddress(found[0], *found[1]) if found is not None else MasterAddress(**cfg.kv_master)


def empty_folder(path: str) -> None:
    """The disk tier's folder, made if missing and emptied: KV of an earlier run under the same name
    and version would match."""
    import shutil
    from pathlib import Path

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for entry in folder.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def main(argv: list[str]) -> None:
    """`--config CFG`: pick the master's ports (the last published or configured ones if free, else
    others; on one machine only), publish them, empty the disk tier (KV of an earlier run under the
    same name and version would match), then exec `mooncake_master`."""
    import os

    from prl.recipe.resolve import load_process_config
    from prl.transport import ports

    if len(argv) != 2 or argv[0] != "--config":
        raise SystemExit("usage: python -m prl.inference.kv_master --config CFG")
    cfg = load_process_config(argv[1])
    addr = address(cfg)
    if cfg.port_fallback:
        addr = MasterAddress(addr.host, *ports.pick(addr.host, [addr.rpc_port, addr.metadata_port, addr.metrics_port]))
        ports.publish(cfg.run_dir, cfg.name, addr.host, [addr.rpc_port, addr.metadata_port, addr.metrics_port])
    pool = cfg.kv_pool
    disk = f"{pool.disk_path.rstrip('/')}/{cfg.run.name}" if pool.disk_path else None
    if disk:
        empty_folder(disk)
    command = master_command(addr, sys.executable, disk, pool.disk_gb)
    print(f"{cfg.name}: master at {addr.master}, metadata {addr.metadata}", flush=True)
    os.execvp(command[0], command)


# What a host needs for the KV pool, run by its Python: the store client imports (it links libibverbs,
# even over TCP) and the packaged `mooncake_master` runs. Prints the master's version line.
MOONCAKE_PROBE = (
    "import os, subprocess, mooncake, mooncake.store\n"
    "b = os.path.join(os.path.dirname(mooncake.__file__), 'mooncake_master')\n"
    "r = subprocess.run([b, '--version'], capture_output=True, text=True, timeout=60)\n"
    "print((r.stdout or r.stderr).strip().splitlines()[0] if (r.stdout or r.stderr).strip() else '')\n"
    "raise SystemExit(r.returncode)\n"
)


def probe_mooncake(python: str = sys.executable) -> str | None:
    """None when this machine's `python` can run the KV pool, else why not (last lines of the error)."""
    import subprocess

    try:
        r = subprocess.run([python, "-c", MOONCAKE_PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if r.returncode == 0:
        return None
    return (r.stderr.strip() or r.stdout.strip())[-400:] or f"the probe exited with status {r.returncode}"


def healthy(addr: MasterAddress, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(addr.health, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def spawn_master(host: str = "127.0.0.1", disk: str | None = None):
    """A master on free ports of `host`, started and answering its health route, with its address
    (benches and tests; a run starts its own as a supervised process). Raises if it exits first."""
    import subprocess
    import time

    from prl.transport import ports

    addr = MasterAddress(host, *ports.pick(host, [0, 0, 0]))
    if disk:
        empty_folder(disk)
    proc = subprocess.Popen(master_command(addr, disk=disk), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not healthy(addr):
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode} before answering {addr.health}")
        time.sleep(0.1)
    return proc, addr


def wait_for_master(cfg, timeout_s: float) -> MasterAddress:
    """Until the run's master answers its health route (it starts beside the servers); its address,
    read again each time (`address`: it may have moved off a taken port)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not healthy(addr := address(cfg)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the KV pool's master at {addr.master} did not answer {addr.health} within "
                               f"{timeout_s:.0f} s (inference.startup_timeout_s)")
        time.sleep(0.2)
    return addr


def vllm_store_config(addr: MasterAddress, hostname: str, memory_gb: float) -> dict:
    """The JSON vLLM's MooncakeStoreConnector reads from MOONCAKE_CONFIG_PATH."""
    return {"metadata_server": addr.metadata, "master_server_address": addr.master, "protocol": "tcp",
            "device_name": "", "mode": "embedded", "local_hostname": hostname,
            "global_segment_size": f"{max(1, int(memory_gb * 1024))}MB", "local_buffer_size": "64MB"}


if __name__ == "__main__":
    main(sys.argv[1:])
