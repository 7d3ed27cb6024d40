"""The collective weight path on CPU (gloo) between real processes: a version broadcast from a sender
into a real embedded server, staged, applied only when asked; a sender killed mid-version leaves the
old version serving, and a new sender forms the group anew."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import start_server
from sshd_rig import free_port
from prl.recipe.schema import Recipe


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    proc, cfg, client = start_server(run_dir, Recipe.model_validate({}))
    yield client, run_dir, f"http://{cfg.host}:{cfg.port}", cfg.secret()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(10)


def state_for(run_dir, version: int) -> dict[str, torch.Tensor]:
    """The run's model with weights no seed gives (so a version shows which weights it carries)."""
    from prl.model.build import build_model

    model = build_model(run_dir / "model", seed=0)
    g = torch.Generator().manual_seed(version)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def send(sink, version: int, state: dict) -> None:
    from prl.trainer.publish import buckets

    sink.begin(version)
    for names in buckets(list(state)):
        sink.put({n: state[n] for n in names})
    sink.seal({"version": version, "format": "memory"})


def sink_for(run_dir, url: str, secret: str):
    from prl.transport.collective import CollectiveSink

    return CollectiveSink(run_dir / "weights", keep=3, servers=lambda: [url], secret=secret, host="127.0.0.1",
                          timeout_s=30)


def generate(client) -> dict:
    r = client.post("/generate", json={"prompt_ids": [5, 6, 7], "max_tokens": 6, "temperature": 0.0,
                                       "stop_token_ids": []})
    assert r.status_code == 200, r.text
    return r.json()


def greedy(client) -> list[float]:
    return generate(client)["completions"][0]["logprobs"]


def test_a_broadcast_version_is_staged_then_applied_whole(server):
    """The version arrives over the group, is staged (the old one serves), and is applied only on
    /update_weights; it serves the same logprobs as the same weights read from a folder."""
    import shutil

    from prl.model.weights import version_dir, write_weights

    client, run_dir, url, secret = server
    sink, state = sink_for(run_dir, url, secret), state_for(run_dir, 1)
    before = client.get("/health").json()["version"]
    send(sink, 1, state)
    assert sink.last.error is None and sink.last.servers == 1 and sink.last.backend == "gloo", sink.last
    assert sink.last.bytes == sum(v.numel() * v.element_size() for v in state.values())
    m = client.get("/metrics").json()
    assert m["collective_staged"] == 1 and m["version"] == before  # staged, not served yet
    shutil.rmtree(version_dir(run_dir / "weights", 1))  # so only the staged copy can serve it
    r = client.post("/update_weights", json={"version": 1})
    assert r.status_code == 200 and r.json() == {**r.json(), "version": 1, "source": "collective"}
    by_collective = greedy(client)
    write_weights(run_dir / "weights" / "v2", state, {"version": 2})
    r = client.post("/update_weights", json={"version": 2})
    assert r.json()["source"] == "folder"
    assert greedy(client) == by_collective


SENDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[4])
    from test_collective import sink_for, state_for
    from pathlib import Path
    from prl.trainer.publish import buckets
    run_dir, url, secret = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    sink, state = sink_for(run_dir, url, secret), state_for(run_dir, 7)
    sink.begin(7)
    first = buckets(list(state))[0]
    sink.put({n: state[n] for n in first})
    print(len(first), flush=True)
    time.sleep(600)  # killed here, mid-version
""")


def kill_sender_mid_version(client, script: str, run_dir, url: str, secret: str) -> None:
    """Run a sender `script` (it prints how many tensors it sent, then sleeps) and SIGKILL it once the server
    holds part of its version."""
    sender = subprocess.Popen([sys.executable, "-c", script, str(run_dir), url, secret, os.path.dirname(__file__)],
                              stdout=subprocess.PIPE, text=True)
    sent = int(sender.stdout.readline())
    while client.get("/metrics").json()["collective_receiving"] < sent:  # the server holds part of it
        assert sender.poll() is None
        time.sleep(0.1)
    sender.kill()
    sender.wait()


def test_a_sender_killed_mid_version_leaves_the_old_version_serving(server):
    client, run_dir, url, secret = server
    send(sink_for(run_dir, url, secret), 6, state_for(run_dir, 6))
    assert client.post("/update_weights", json={"version": 6}).json()["source"] == "collective"
    kill_sender_mid_version(client, SENDER, run_dir, url, secret)
    r = client.post("/update_weights", json={"version": 7})  # waits for the broken receive; no folder either
    assert r.status_code == 409 and "still serving v6" in r.json()["detail"]
    m = client.get("/metrics").json()
    assert m["version"] == 6 and m["collective_receiving"] == -1
    assert greedy(client)  # still serving
    # a restarted sender forms the group anew and delivers
    sink = sink_for(run_dir, url, secret)
    send(sink, 8, state_for(run_dir, 8))
    assert sink.last.error is None and sink.last.servers == 1
    assert client.post("/update_weights", json={"version": 8}).json()["source"] == "collective"


def test_a_version_that_does_not_fit_the_model_is_refused_before_it_is_staged(server):
    """A tensor of the wrong shape on the wire fails the receive (nothing allocated for it, nothing
    staged); the folder, with the same bad tensor, is refused too, and the old version serves."""
    client, run_dir, url, secret = server
    served = client.get("/health").json()["version"]
    state = state_for(run_dir, 9)
    name = next(iter(state))
    state[name] = torch.zeros(3, 3)
    sink = sink_for(run_dir, url, secret)
    send(sink, 9, state)
    assert sink.last.servers == 0 and "shape" in " ".join(sink.last.failed)
    r = client.post("/update_weights", json={"version": 9})
    assert r.status_code == 409 and client.get("/health").json()["version"] == served


def test_the_group_is_nccl_only_when_every_member_holds_a_gpu():
    from prl.transport.collective import pick_backend

    assert pick_backend("cuda", ["cuda", "cuda"], nccl=True) == "nccl"
    assert pick_backend("cuda", ["cuda", "cpu"], nccl=True) == "gloo"  # one CPU server: all through host memory
    assert pick_backend("cpu", ["cuda"], nccl=True) == "gloo"
    assert pick_backend("cuda", ["cuda"], nccl=False) == "gloo"  # a torch without NCCL
    assert pick_backend("cuda", [], nccl=True) == "gloo"


def test_a_cpu_server_refuses_an_nccl_group_by_name_and_keeps_serving(server):
    """The server says where its tensors sit; asked to join an NCCL group anyway (a sender that did not
    ask), it answers 409 naming why, keeps serving, and the next gloo group delivers."""
    client, run_dir, url, secret = server
    headers = {"Authorization": f"Bearer {secret}"}
    import httpx

    assert httpx.get(url + "/weights/collective/members", headers=headers).json() == {"members": 1, "device": "cpu",
                                                                                   "experts": [None]}
    r = httpx.post(url + "/weights/collective/join", headers=headers, timeout=30,
                   json={"addr": "127.0.0.1", "port": 1, "world": 2, "rank": 1, "epoch": 99, "backend": "nccl"})
    assert r.status_code == 409 and "NCCL weight group needs CUDA" in r.json()["detail"], r.text
    assert greedy(client)
    sink = sink_for(run_dir, url, secret)
    send(sink, 11, state_for(run_dir, 11))
    assert sink.last.error is None and sink.last.servers == 1 and sink.last.backend == "gloo"


# ---------------------------------------------------------------- several senders (trainer.weight_transfer = "stream")
WIRE_MEMBER = textwrap.dedent("""
    import sys, torch
    from prl.transport.collective import GroupInfo, Wire, routes
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    shares = [[0, 1, 2, 3], [4, 5, 6, 7]]
    def state():
        g = torch.Generator().manual_seed(0)
        out = {}
        for layer in range(3):
            out[f"model.layers.{layer}.self_attn.q_proj.weight"] = torch.randn(16, 8, generator=g).to(torch.bfloat16)
            for e in range(8):
                out[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] = torch.randn(8, 4, generator=g)
        return out
    full = state()
    buckets = [[k for k in full if f".{layer}." in k] for layer in range(3)]
    store = None
    if rank == 0:
        import datetime, torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=True, timeout=datetime.timedelta(seconds=60))
    wire = Wire(GroupInfo("127.0.0.1", port, 4, rank, 1, 60.0, "gloo", senders=2), store)
    if rank < 2:
        sent = 0
        for b, names in enumerate(buckets):
            if b % 2 == rank:
                part = {n: full[n] for n in names}
                sent += wire.send_bucket(part, routes(part, shares))
        wire.send_end({"version": 5})
        print("sent", sent, flush=True)
    else:
        mine = shares[rank - 2]
        want = {k: v for k, v in full.items() if ".experts." not in k or int(k.split(".experts.")[1].split(".")[0]) in mine}
        got, meta = wire.receive({k: (list(v.shape), v.numel() * 4) for k, v in full.items()})
        assert meta == {"version": 5}, meta
        assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
        assert all(torch.equal(got[k], want[k]) for k in want)
        print("got", len(got), flush=True)
    import os
    os._exit(0)  # as the trainer leaves: no interpreter teardown under gloo's threads (it can abort)
""")


def test_two_senders_stream_each_receiver_only_its_experts(tmp_path):
    """Two senders (trainer ranks) each stream their buckets on their own link; each of two receivers
    takes every dense tensor and only the experts it serves, bit-equal, nothing else allocated."""
    port = free_port("127.0.0.1")
    procs = [subprocess.Popen([sys.executable, "-c", WIRE_MEMBER, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert [o.split()[0] for o in outs] == ["sent", "sent", "got", "got"]
    assert [int(o.split()[1]) for o in outs[2:]] == [3 + 3 * 4] * 2  # 3 dense, 3 layers x 4 experts each


STREAM_SENDER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[5])
    from pathlib import Path
    from test_collective import state_for
    from prl.model.build import build_model
    from prl.trainer.publish import publish
    from prl.transport.collective import CollectiveSink, over_the_trainer
    run_dir, url, secret, fmt = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[6]
    versions = [int(v) for v in sys.argv[4].split(",")]
    version = versions[0]
    die_at = int(os.environ.get("DIE_AT_BUCKET", "-1"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if fmt == "hf":  # a pretrained folder served by vLLM: its weights moved as test_vllm.perturbed_state does
        model = build_model(run_dir / "model")
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    else:
        model = build_model(run_dir / "model", seed=0)
        model.load_state_dict(state_for(run_dir, version))
    share, agree = over_the_trainer()
    sink = CollectiveSink(run_dir / "weights", keep=3, servers=lambda: [url], secret=secret, host="127.0.0.1",
                          timeout_s=30, rank=rank, senders=2, share=share, agree=agree)
    if die_at >= 0 and rank == 1:
        put = sink.put
        def dying(bucket, stream=True):
            put(bucket, stream)
            sink.wait_sent()
            os._exit(3)  # mid-version, after its first bucket
        sink.put = dying
    whole = os.environ.get("WHOLE", "1") == "1"
    for k, version in enumerate(versions):
        if k:  # the server leaves the group (a join it cannot complete), so it misses this version's stream
            import httpx
            model.load_state_dict(state_for(run_dir, version))
            if rank == 0 and os.environ.get("KNOCK", "1") == "1":
                httpx.post(url + "/weights/collective/join", headers={"Authorization": f"Bearer {secret}"}, timeout=30,
                           json={"addr": "127.0.0.1", "port": 1, "world": 3, "rank": 2, "epoch": 99, "timeout_s": 1,
                                 "senders": 2})
            dist.barrier()
        publish(model, sink, version, hf_format=fmt == "hf", whole=whole)
        print("rank", rank, "error", sink.last.error, "servers", sink.last.servers, "senders", sink.last.senders,
              "missed", sink.missed, flush=True)
    os._exit(0)  # as the trainer leaves: no interpreter teardown under gloo's threads (it can abort)
""")


def stream(run_dir, url, secret, version, die: bool = False, fmt: str = "memory", whole: bool = True,
           knock: bool = True) -> list[str]:
    """Version `version` (or "a,b": two, the server knocked out of the group between them) published by
    two real trainer ranks (a gloo group), each streaming its buckets (`fmt` "hf": checkpoint names, for
    vLLM; not `whole`: rank 0 writes no tensors unless a server missed the stream)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")), "WORLD_SIZE": "2",
           "WHOLE": "1" if whole else "0", "KNOCK": "1" if knock else "0", **({"DIE_AT_BUCKET": "0"} if die else {})}
    procs = [subprocess.Popen([sys.executable, "-c", STREAM_SENDER, str(run_dir), url, secret, str(version),
                               os.path.dirname(__file__), fmt], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    return [p.communicate(timeout=180)[0] for p in procs]


def test_two_trainer_ranks_stream_a_version_and_a_dead_one_costs_only_that_version(server):
    """`publish` from two trainer ranks: each streams the buckets it owns into the embedded server, which
    serves the same logprobs as the same weights from rank 0's folder. A rank that dies mid-version
    fails the server's receive (rank 0 does not hang), the version comes by the folder, and the next
    pair of ranks forms the group anew and streams again."""
    from prl.model.weights import write_weights

    client, run_dir, url, secret = server
    staged = client.get("/metrics").json()["collective_staged"]
    outs = stream(run_dir, url, secret, 21)
    assert all("error None" in o and "senders 2" in o for o in outs), outs
    assert "servers 1" in outs[0]
    assert client.get("/metrics").json()["collective_staged"] == staged + 1
    assert client.post("/update_weights", json={"version": 21}).json()["source"] == "collective"
    streamed = greedy(client)
    write_weights(run_dir / "weights" / "v22", state_for(run_dir, 21), {"version": 22})
    assert client.post("/update_weights", json={"version": 22}).json()["source"] == "folder"
    assert greedy(client) == streamed

    outs = stream(run_dir, url, secret, 23, die=True)
    assert "error None" not in outs[0] and "servers 0" in outs[0], outs  # rank 0 finished, the stream failed
    assert client.get("/metrics").json()["collective_staged"] == staged + 1
    r = client.post("/update_weights", json={"version": 23})
    assert r.status_code == 200 and r.json()["source"] == "folder", r.text  # rank 0's folder is whole

    outs = stream(run_dir, url, secret, 24)
    assert all("error None" in o for o in outs), outs
    assert client.post("/update_weights", json={"version": 24}).json()["source"] == "collective"
    # a trainer ahead of the orchestrator: v31 streams before v30 is asked for; asked for v30, the server
    # serves the newest it holds (v31, labelled v31), v30 is counted as skipped, and v31 is served already
    skipped = client.get("/metrics").json()["weights_skipped"]
    outs = stream(run_dir, url, secret, "30,31", knock=False)
    assert all(o.count("error None") == 2 for o in outs), outs
    r = client.post("/update_weights", json={"version": 30}).json()
    assert (r["version"], r["source"]) == (31, "collective"), r
    assert client.post("/update_weights", json={"version": 31}).json()["source"] == "served"
    assert client.get("/metrics").json()["weights_skipped"] == skipped + 1
    assert {v for c in generate(client)["completions"] for v in c["versions"]} == {31}


def test_a_streamed_version_seals_an_empty_folder_and_one_a_server_missed_is_written_whole(server):
    """Not `whole` (the stream's versions between checkpoints): every server staged v35, so rank 0 seals
    its folder without tensors; asked for it again while serving it (a restarted orchestrator), the
    server answers at once. The server then leaves the group, misses v36's stream, and every rank
    publishes v36 again, whole: the server loads it from the folder with the same logprobs as v36's
    weights. Asked for v35 again while serving v36, the server keeps v36 and counts v35 as skipped."""
    from prl.model.weights import read_weights, version_dir, write_weights

    client, run_dir, url, secret = server
    outs = stream(run_dir, url, secret, "35,36", whole=False)
    first, second = (o.splitlines() for o in outs)
    assert "error None" in first[0] and "missed False" in first[0], outs
    assert "servers 0" in first[1] and "missed True" in first[1], outs  # rank 0 saw the miss
    v35 = version_dir(run_dir / "weights", 35)
    assert [p.name for p in v35.iterdir()] == ["MANIFEST.json"]
    assert client.post("/update_weights", json={"version": 35}).json()["source"] == "collective"
    assert client.post("/update_weights", json={"version": 35}).json()["source"] == "served"
    state, manifest = read_weights(version_dir(run_dir / "weights", 36))
    assert not manifest.get("streamed_only") and len(state) == len(state_for(run_dir, 36))
    assert client.post("/update_weights", json={"version": 36}).json()["source"] == "folder"
    from_folder = greedy(client)
    skipped = client.get("/metrics").json()["weights_skipped"]
    r = client.post("/update_weights", json={"version": 35})  # older than the one served: never goes back
    assert r.json() == {**r.json(), "version": 36, "source": "served"}, r.text
    assert client.get("/metrics").json()["weights_skipped"] == skipped + 1
    write_weights(run_dir / "weights" / "v37", state_for(run_dir, 36), {"version": 37})
    client.post("/update_weights", json={"version": 37})
    assert greedy(client) == from_folder


def test_each_vllm_worker_is_sent_the_experts_of_its_slots():
    """vLLM's linear placement of the physical slots over an engine's workers, each slot loaded with its
    expert (the redundant slots of EPLB cycling through the experts): what the stream routes to each."""
    from types import SimpleNamespace

    from prl.backends.vllm.collective import shares

    def cfg(ep: bool, redundant: int = 0):
        return SimpleNamespace(inference=SimpleNamespace(expert_parallel=ep, vllm={}, redundant_experts=redundant))

    assert shares(cfg(False), 3, 8) == [None, None, None]  # without expert parallelism every worker holds all
    assert shares(cfg(True), 1, 8) == [None]
    assert shares(cfg(True), 3, 8) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # the remainder on the first ranks
    assert shares(cfg(True, redundant=1), 3, 8) == [[0, 1, 2], [3, 4, 5], [0, 6, 7]]  # slot 8 holds expert 0
    assert shares(cfg(True, redundant=4), 4, 8) == [[0, 1, 2], [3, 4, 5], [0, 6, 7], [1, 2, 3]]


def test_a_server_that_answers_why_it_did_not_load_is_taken_out_never_killed(tmp_path):
    """A server asked for a version that went by the stream only, which it missed, answers 503 naming
    why: the orchestrator's pool takes it out until a later version (it rejoins on the next one) but
    does not report it hung or stuck, so the driver never kills it; it serves on meanwhile."""
    import asyncio

    from prl.backends.registry import make_backend
    from prl.metrics import EventLog, read_events
    from prl.model.weights import commit_dir, tmp_dir_for, version_dir, write_weights
    from prl.orchestrator.servers import ServerPool

    proc, cfg, client = start_server(tmp_path, Recipe.model_validate({}))
    weights = tmp_path / "weights"
    commit_dir(tmp_dir_for(version_dir(weights, 3)), version_dir(weights, 3), {"version": 3, "streamed_only": True})
    write_weights(version_dir(weights, 4), state_for(tmp_path, 4), {"version": 4})

    async def go():
        pool = ServerPool([make_backend("embedded", f"http://{cfg.host}:{cfg.port}", cfg.secret())],
                          EventLog(tmp_path / "m.jsonl", "orchestrator"), asyncio.Condition(), hang_timeout_s=30)
        try:
            await pool.start(30)
            await pool.load_all(3)
            assert not pool.servers[0].up
            pool.served = 4  # the next version, written whole
            await pool.rejoin(pool.servers[0])
            assert pool.servers[0].up and pool.servers[0].backend.version == 4
        finally:
            await pool.servers[0].backend.close()

    try:
        asyncio.run(go())
        kinds = [(e["kind"], e.get("state"), e.get("cause", "")) for e in read_events(tmp_path / "m.jsonl")[0]]
        assert not [k for k in kinds if k[0] == "unresponsive"], kinds
        assert any(k[1] == "down" and "[prl: streamed only]" in k[2] for k in kinds), kinds
        assert proc.poll() is None and greedy(client)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
