"""`bin/gpu-check` runs here too (CPU paths: the FP8 reference against float64, gloo collectives of the
EP/CP exchanges, R3 on CPU kernels), so the script a GPU session runs cannot rot in between."""

import json
import subprocess

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_gpu_check_runs_its_cpu_paths(tmp_path):
    out = tmp_path / "gpu-check.json"
    p = subprocess.run([str(ROOT / "bin" / "gpu-check"), "--quick", "--out", str(out)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["failed"] == [] and r["device"] == "CPU (no GPU present)"
    assert set(r["fp8"]) == {f"{g} M=256 N=384 K=512" for g in ("fprop", "dgrad", "wgrad")}
    assert all(row["reference_vs_float64"]["ok"] for row in r["fp8"].values())
    gloo = r["collectives"]["gloo"]
    assert gloo["ok"] and gloo["all_to_all_uneven"] and gloo["all_gather_backward"], gloo
    r3 = r["r3"]  # bf16 against bf16 on CPU kernels: agreement is near-exact (the figures are for a GPU)
    assert r3["ok"] and r3["mismatch_kl_no_replay"] >= 0 and r3["mismatch_kl_replay"] >= 0, r3
    assert 0.5 < r3["routing_agreement"] <= 1, r3
