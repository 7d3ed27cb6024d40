"""`bin/gpu-check`: a path that is not present here (no device, a package not installed, too few GPUs)
is listed as absent; a path that is present and raises fails the check, with its traceback. The
script runs here too (CPU paths: the FP8 reference against float64, gloo collectives of the EP/CP
exchanges, the weight path over gloo, R3 on CPU kernels, the tests marked gpu skipping with reasons), so it cannot rot between
GPU sessions. Every mechanism `prl plan` marks "built, needs GPU" has a test marked gpu that checks it
(tests/test_gpu.py's `COVERS`)."""

import ast
import json
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.append(str(ROOT / "bench"))
import gpu_check  # noqa: E402 - bench/ is not a package

TESTS = ROOT / "tests"


def cuda_kernel_fault():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def broken_install():
    """An installed package whose own import fails (a library it links is missing): present, failed."""
    raise ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")


def missing_package():
    gpu_check.require_module("prl_no_such_gemm_library")
    raise AssertionError("not reached")


def too_few_gpus():
    gpu_check.require_cuda(gpus=10_000)
    raise AssertionError("not reached")


def test_absent_and_failed_are_different_results():
    results = {"fp8": {"row": {name: gpu_check.attempt(fn) for name, fn in
                               (("raised", cuda_kernel_fault), ("broken", broken_install),
                                ("missing", missing_package), ("gpus", too_few_gpus))}}}
    row = results["fp8"]["row"]
    assert row["missing"] == {"absent": "prl_no_such_gemm_library is not installed"}
    assert row["gpus"]["absent"] in ("no CUDA device", f"needs 10000 GPUs, {gpu_check.torch.cuda.device_count()} present")
    for name in ("raised", "broken"):
        assert row[name]["ok"] is False and row[name]["error"].startswith("Traceback"), row[name]
    assert "illegal memory access" in row["raised"]["error"] and "libcudart" in row["broken"]["error"]
    assert gpu_check.failed(results) == ["fp8/row/raised", "fp8/row/broken"]
    assert set(gpu_check.absent(results)) == {"fp8/row/missing", "fp8/row/gpus"}


def run_main(monkeypatch, capsys, tmp_path, section) -> tuple[int, str, dict]:
    monkeypatch.setattr(gpu_check, "SECTIONS", {"probe": lambda args: section})
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--out", str(out)])
    return exit_.value.code, capsys.readouterr().out, json.loads(out.read_text())


def test_a_path_that_raised_fails_the_check_and_prints_its_traceback(monkeypatch, capsys, tmp_path):
    code, printed, r = run_main(monkeypatch, capsys, tmp_path, {"deep_gemm": gpu_check.attempt(cuda_kernel_fault),
                                                                "scaled_mm": gpu_check.attempt(missing_package)})
    assert code == 1
    assert r["failed"] == ["probe/deep_gemm"] and r["absent"] == {"probe/scaled_mm": "prl_no_such_gemm_library is not installed"}
    tail = printed[printed.index("## FAILED probe/deep_gemm"):]
    assert "Traceback (most recent call last)" in tail and "in cuda_kernel_fault" in tail and "illegal memory" in tail
    assert "FAILED: probe/deep_gemm" in printed.splitlines()[-2]
    assert json.loads(printed.splitlines()[-1])["failed"] == ["probe/deep_gemm"]


def test_paths_not_present_are_listed_and_pass(monkeypatch, capsys, tmp_path):
    code, printed, r = run_main(monkeypatch, capsys, tmp_path, {"nccl": gpu_check.attempt(too_few_gpus), "ok": True})
    assert code == 0 and r["failed"] == [] and list(r["absent"]) == ["probe/nccl"]
    assert "## not present here" in printed and printed.splitlines()[-2].endswith("all checks passed (1 not present here)")


def test_the_gpu_tests_outcomes_are_read_from_pytests_report():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.test_gpu" name="test_a[scaled_mm]" time="1.5"/>
      <testcase classname="tests.test_gpu" name="test_b" time="0.1"><failure message="assert 1 == 2">trace</failure></testcase>
      <testcase classname="tests.test_gpu" name="test_c" time="0"><skipped message="needs 2 GPUs, 1 present">x</skipped></testcase>
    </testsuite></testsuites>"""
    got = gpu_check.junit_outcomes(xml)
    assert got["tests/test_gpu.py::test_a[scaled_mm]"]["outcome"] == "passed"
    assert got["tests/test_gpu.py::test_b"]["outcome"] == "failed" and "assert 1 == 2\ntrace" == got["tests/test_gpu.py::test_b"]["error"]
    assert got["tests/test_gpu.py::test_c"] == {"outcome": "skipped", "seconds": 0.0, "reason": "needs 2 GPUs, 1 present"}


@pytest.mark.slow
def test_gpu_check_runs_its_cpu_paths(tmp_path):
    out = tmp_path / "gpu-check.json"
    p = subprocess.run([str(ROOT / "bin" / "gpu-check"), "--quick", "--out", str(out)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["failed"] == [] and r["device"] == "CPU (no GPU present)"
    assert set(r["fp8"]) == {"prl_backend", "dispatch_packing"} | {f"{g} M=256 N=384 K=512" for g in ("fprop", "dgrad", "wgrad")}
    assert r["fp8"]["prl_backend"] == "reference"
    assert r["fp8"]["dispatch_packing"]["ok"] and r["fp8"]["dispatch_packing"]["bytes_equal_to_cpu"] == 1.0
    rows = [v for k, v in r["fp8"].items() if k not in ("prl_backend", "dispatch_packing")]
    assert all(row["reference_vs_float64"]["ok"] for row in rows)
    assert all(row[b] == {"absent": "no CUDA device"} for row in rows for b in ("scaled_mm", "deep_gemm"))
    assert r["collectives"]["nccl"] == {"absent": "no CUDA device"}
    gloo = r["collectives"]["gloo"]
    assert gloo["ok"] and gloo["all_to_all_uneven"] and gloo["all_gather_backward"], gloo
    assert r["weights"]["nccl"] == {"absent": "no CUDA device"}
    assert r["weights"]["gloo"]["equal"] and r["weights"]["gloo"]["device"] == "cpu", r["weights"]
    r3 = r["r3"]  # bf16 against bf16 on CPU kernels: agreement is near-exact (the figures are for a GPU)
    assert r3["ok"] and r3["mismatch_kl_no_replay"] >= 0 and r3["mismatch_kl_replay"] >= 0, r3
    assert 0.5 < r3["routing_agreement"] <= 1, r3
    tests = r["gpu_tests"]  # every test marked gpu collects here and skips, saying why
    assert tests["collected"] >= 5 and tests["ran"] == [] and len(tests["skipped"]) == tests["collected"], tests
    assert all("CUDA" in why for why in tests["skipped"].values()), tests["skipped"]
    assert "## tests marked gpu:" in p.stdout and "SKIPPED tests/test_gpu.py::" in p.stdout


# ---------------------------------------------------------------- every GPU mechanism has a gpu test
def gpu_marked_tests(path) -> set[str]:
    """Module-level test functions of a test file marked gpu (their own decorator or the module's pytestmark),
    read from its source: the file is not imported (its GPU packages may be absent here)."""
    tree = ast.parse(path.read_text())

    def gpu(node) -> bool:
        return any(isinstance(n, ast.Attribute) and ast.unparse(n) == "pytest.mark.gpu" for n in ast.walk(node))

    module = any(isinstance(s, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in s.targets)
                 and gpu(s.value) for s in tree.body)
    return {s.name for s in tree.body if isinstance(s, ast.FunctionDef) and s.name.startswith("test_")
            and (module or any(gpu(d) for d in s.decorator_list))}


def uncovered() -> list[str]:
    """What is wrong with tests/test_gpu.py's COVERS against prl.sizing.mechanisms: a mechanism marked "built,
    needs GPU" without a gpu test, a name that is not a test marked gpu, a mechanism not marked so."""
    from prl.sizing.mechanisms import GPU, MECHANISMS

    tree = ast.parse((TESTS / "test_gpu.py").read_text())
    covers = next(ast.literal_eval(s.value) for s in tree.body if isinstance(s, ast.Assign)
                  and any(getattr(t, "id", None) == "COVERS" for t in s.targets))
    on_gpu = {name for name, (status, _) in MECHANISMS.items() if status == GPU}
    problems = [f"{m}: built, needs GPU, and no gpu test names it" for m in sorted(on_gpu) if not covers.get(m)]
    problems += [f"{m}: in COVERS but not built, needs GPU" for m in sorted(set(covers) - on_gpu)]
    for mechanism, names in covers.items():
        for name in names:
            file, _, test = name.rpartition("::")
            path = TESTS / (file or "test_gpu.py")
            if not path.exists() or test not in gpu_marked_tests(path):
                problems.append(f"{mechanism}: {name} is not a test marked gpu in tests/{path.name}")
    return problems


def test_every_mechanism_that_needs_a_gpu_has_a_gpu_test():
    assert uncovered() == []


def test_a_gpu_mechanism_without_a_test_or_a_name_without_a_gpu_test_is_caught(monkeypatch):
    from prl.sizing import mechanisms

    monkeypatch.setitem(mechanisms.MECHANISMS, "new_kernel", (mechanisms.GPU, "a mechanism added without a test"))
    monkeypatch.setitem(mechanisms.MECHANISMS, "overlap", (mechanisms.BUILT, "as if a CPU test now covered it"))
    assert uncovered() == ["new_kernel: built, needs GPU, and no gpu test names it",
                           "overlap: in COVERS but not built, needs GPU"]
    assert "test_absent_and_failed_are_different_results" not in gpu_marked_tests(TESTS / "test_gpu_check.py")
    assert "test_two_data_parallel_engines_serve_and_take_each_version" in gpu_marked_tests(TESTS / "test_vllm_dp.py")
    assert "test_the_launcher_passes_the_serving_layout_and_cpu_refuses_it" not in gpu_marked_tests(TESTS / "test_vllm_dp.py")
