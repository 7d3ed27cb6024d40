import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def import_failure(module: str, package: str, how: str = "bin/test installs it") -> str | None:
    """None when `module` imports; else why not: `package` is not installed, or it is installed and
    the import fails (the error, e.g. a shared library its binaries link that this machine lacks)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{package} is not installed ({how})"
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is reported, with its text
        return f"{package} is installed but `import {module}` fails: {type(e).__name__}: {e}"
    return None


def import_or_skip(module: str, package: str):
    """`module`, imported; else skip the test with `import_failure`'s reason."""
    why = import_failure(module, package)
    if why:
        pytest.skip(why)
    return importlib.import_module(module)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    return write_model_dir(ModelCfg(), tmp_path_factory.mktemp("model"))


@pytest.fixture
def tiny_model(model_dir):
    from prl.model.build import build_model

    return build_model(model_dir, seed=0)


def prl_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "prl", *map(str, args)]


def run_each(commands: list[list[str]], timeout: float = 120, at_once: int = 2) -> list:
    """Each command run as `subprocess.run(..., capture_output=True, text=True)` would, `at_once` at a time (a
    `prl` process spends seconds importing torch and transformers before it checks anything); in order."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True, timeout=timeout), commands))


@pytest.fixture(scope="session")
def rig(tmp_path_factory):
    """Two real sshd hosts (own network namespace each, else own loopback address), a client key,
    and a known_hosts file."""
    from sshd_rig import SSHD, keygen, start_hosts, stop_hosts

    if not os.access(SSHD, os.X_OK):
        pytest.skip(f"no sshd ({SSHD}): the multi-host tests need openssh-server (bin/test installs it as root)")
    root = tmp_path_factory.mktemp("ssh")
    client_key = keygen(root / "client_key")
    hosts, net = start_hosts(root, 2, root / "client_key.pub")
    known = root / "known_hosts"
    known.write_text("".join(h.known_hosts_line() + "\n" for h in hosts))
    yield {"key": str(client_key), "known": str(known), "hosts": hosts, "root": root, "netns": net is not None}
    stop_hosts(hosts, net)


def start_server(run_dir: Path, recipe, timeout: float = 60, name: str | None = None):
    """A real server of the run (`python -m prl.inference`, or the role's own module; its own process group) for
    `recipe`'s first server (or the process `name`, e.g. "teacher-0", "reward-model-0"), in `run_dir`, once it
    answers /health:
    (process, its config, an authenticated client). A server that dies while starting fails at once, with its log."""
    import subprocess
    import time

    import httpx

    from prl.model.tiny import write_model_dir
    from prl.launch.configs import resolve
    from prl.launch.processes import process_command
    from prl.recipe.resolve import write_configs, write_secret

    write_model_dir(recipe.model, run_dir / "model")
    configs = resolve(recipe, run_dir, write_secret(run_dir))
    cfg = next(c for c in configs if c.name == name) if name else configs[0]
    assert write_configs(configs, run_dir)[cfg.name] == Path(cfg.config_path)
    log = open(run_dir / "server.log", "wb")
    proc = subprocess.Popen(process_command(cfg),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = httpx.Client(base_url=f"http://{cfg.host}:{cfg.port}", headers={"Authorization": f"Bearer {cfg.secret()}"},
                          timeout=timeout)
    while True:
        try:
            if client.get("/health").status_code == 200:
                return proc, cfg, client
        except httpx.TransportError:
            pass
        assert proc.poll() is None, (run_dir / "server.log").read_text()
        time.sleep(0.2)
