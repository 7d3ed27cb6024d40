"""Provisioning on a real host (this machine through LocalHost): the wheel key ignores rebuild
timestamps, a venv is built once per key and reused warm, and a fixed `cluster.venv` is used."""

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prl.launch.hosts import LocalHost
from prl.launch.provision import build_wheel, provision, wheel_key
from prl.recipe.schema import ClusterCfg

pytestmark = pytest.mark.slow


def test_wheel_key_is_stable_across_rebuilds(tmp_path):
    first = build_wheel(tmp_path / "one")
    time.sleep(1.1)  # zip timestamps have 2 s resolution; the key must not see them
    second = build_wheel(tmp_path / "two")
    assert wheel_key(first, []) == wheel_key(second, [])
    assert wheel_key(first, ["vllm"]) != wheel_key(first, [])


@pytest.mark.parametrize("fixed", [False, True])
def test_cold_then_warm(tmp_path, fixed):
    cluster = ClusterCfg(hosts=[{"address": "127.0.0.1", "name": "a"}], workdir=str(tmp_path / "work"),
                         python=sys.executable, venv=str(tmp_path / "env") if fixed else None)
    with ThreadPoolExecutor(2) as pool:
        cold, key = provision({"a": LocalHost()}, cluster, pool)
        warm, again = provision({"a": LocalHost()}, cluster, pool)
    assert (cold["a"].state, warm["a"].state, again) == ("cold", "warm", key)
    python = cold["a"].python
    assert python == (f"{tmp_path}/env/bin/python" if fixed else f"{tmp_path}/work/venvs/{key}/bin/python")
    where = subprocess.run([python, "-c", "import prl, torch; print(prl.__file__)"], cwd="/",
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(python.removesuffix("bin/python")), "prl comes from the wheel in the venv"
