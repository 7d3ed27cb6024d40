"""`prl doctor` against real sshd hosts: two good ones and an unreachable one; and an unknown key."""

import subprocess
import sys

from conftest import prl_cmd
from sshd_rig import host_port


def cluster_recipe(tmp_path, rig, extra_hosts="", known=None):
    lines = ["[cluster]", f"workdir = '{tmp_path}/work'", f"known_hosts = '{known or rig['known']}'",
             f"python = '{sys.executable}'",
             f"rendezvous_port = {host_port(rig['hosts'][0])}", "min_free_gb = 0.01"]
    for h in rig["hosts"]:
        lines += ["[[cluster.hosts]]", f"address = '{h.address}'", f"port = {h.port}", f"key_file = '{rig['key']}'"]
    path = tmp_path / "cluster.toml"
    path.write_text("\n".join(lines) + "\n" + extra_hosts)
    return path


def test_doctor_names_the_unreachable_host(rig, tmp_path):
    bad = f"[[cluster.hosts]]\naddress = '127.0.0.9'\nport = 1\nkey_file = '{rig['key']}'\n"
    p = subprocess.run(prl_cmd("doctor", cluster_recipe(tmp_path, rig, bad)), capture_output=True, text=True,
                       timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin:/usr/sbin"})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "127.0.0.9: reachable:" in p.stderr and "unreachable" in p.stderr
    a, b = rig["hosts"]
    assert f"{a.address}:" not in p.stderr and f"{b.address}:" not in p.stderr, p.stderr
    assert f"reaches {a.address}:" in p.stdout


def test_doctor_passes_on_good_hosts_and_refuses_unknown_keys(rig, tmp_path):
    """Host b (the inference host, so the sandbox workers' host) runs a program in the sandbox."""
    code_env = "[env]\nkind = 'code'\nmax_total_tokens = 64\n"
    ok = subprocess.run(prl_cmd("doctor", cluster_recipe(tmp_path, rig, code_env)), capture_output=True, text=True,
                        timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin:/usr/sbin"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    a, b = rig["hosts"]
    rows = {ln.split("│")[1].strip(): ln for ln in ok.stdout.splitlines() if ln.count("│") > 2}
    assert "ok runs programs (namespaces" in rows[b.address] and "runs programs" not in rows[a.address], ok.stdout
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    p = subprocess.run(prl_cmd("doctor", cluster_recipe(tmp_path, rig, known=empty)), capture_output=True,
                       text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin:/usr/sbin"})
    assert p.returncode == 1 and "unknown host key" in p.stderr


def test_reach_check_names_what_it_cannot_reach():
    """The connect probe on a real host: a listening port passes, a closed one is named."""
    import socket

    from prl.launch.doctor import reach_check
    from prl.launch.hosts import LocalHost
    from prl.launch.placement import Link
    from prl.recipe.schema import ClusterCfg

    cfg = ClusterCfg(hosts=[{"address": "127.0.0.1"}], python=sys.executable)
    with socket.socket() as open_, socket.socket() as closed:
        open_.bind(("127.0.0.1", 0))
        open_.listen(1)
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        ok, bad = open_.getsockname()[1], closed.getsockname()[1]
        good = reach_check(LocalHost(), [Link("a", "b", "127.0.0.1", ok)], cfg)
        fail = reach_check(LocalHost(), [Link("a", "b", "127.0.0.1", ok), Link("a", "c", "127.0.0.1", bad)], cfg)
    assert good.ok and f"127.0.0.1:{ok}" in good.detail
    assert not fail.ok and fail.detail.startswith(f"cannot reach 127.0.0.1:{bad}") and f":{ok}" not in fail.detail


def test_doctor_checks_the_model_folder_and_vllm_where_the_roles_need_them(rig, tmp_path):
    """Trainer and inference hosts read `model.path` in place; vLLM servers' hosts must import vllm."""
    from test_pretrained import make_pretrained
    from vllm_rig import vllm_available

    folder = make_pretrained(tmp_path / "qwen3-tiny")
    extra = f"[model]\narch = 'qwen3_moe'\npath = '{folder}'\n[inference]\nbackend = 'vllm'\n"
    env = {"COLUMNS": "250", "PATH": "/usr/bin:/bin:/usr/sbin"}
    good = subprocess.run(prl_cmd("doctor", cluster_recipe(tmp_path, rig, extra)), capture_output=True, text=True,
                          timeout=120, env=env)
    if vllm_available():
        assert good.returncode == 0, good.stdout + good.stderr
        assert "has config and weights" in good.stdout and "vllm 0.32" in good.stdout
    missing = extra.replace(str(folder), str(tmp_path / "nowhere"))
    p = subprocess.run(prl_cmd("doctor", cluster_recipe(tmp_path, rig, missing)), capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 1
    for h in rig["hosts"]:  # a trains, b serves: both read the folder
        assert f"{h.address}: model: model.path {tmp_path / 'nowhere'}" in p.stderr, p.stderr
