"""The trainer endpoint over real HTTP on loopback: batches in (whole or refused, a late or
restarted endpoint tolerated), weight versions out (long poll, verified per-host copies)."""

import asyncio
import socket
import threading
import time

import pytest
import torch

from prl.model.weights import write_weights
from prl.recipe.resolve import free_port
from prl.transport.batch import Sample, TrainBatch, pack
from prl.transport.endpoint import TrainerEndpoint
from prl.transport.trainer_client import TrainerClient
from prl.transport.weights import HttpFetch, WeightFetchError

SECRET = "s3cret"


def a_batch(step: int) -> TrainBatch:
    samples = [Sample([1, 2, 3], [4, 5], [-0.5, -0.25], [step, step], 0.5, 1.0) for _ in range(4)]
    return TrainBatch(step, pack(samples, 2, 64), data_position=7)


@pytest.fixture
def endpoint(tmp_path):
    ep = TrainerEndpoint(tmp_path / "trainer", SECRET, "127.0.0.1", 0).start()
    yield ep
    ep.stop()


def url(ep: TrainerEndpoint) -> str:
    return f"http://127.0.0.1:{ep.port}"


def test_batch_arrives_whole_and_secret_is_required(endpoint):
    async def go():
        client = TrainerClient(url(endpoint), SECRET)
        await client.send_batch(a_batch(3))
        await client.close()
        bad = TrainerClient(url(endpoint), "wrong", deadline_s=1)
        with pytest.raises(Exception, match="401"):
            await bad.send_batch(a_batch(4))
        await bad.close()

    asyncio.run(go())
    got = endpoint.inbox.receive(3, timeout=1)
    want = a_batch(3)
    assert got.data_position == 7 and len(got.micro_batches) == 2
    for a, b in zip(got.micro_batches[0], want.micro_batches[0], strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.infer_logprobs, b.infer_logprobs)
    assert not endpoint.inbox.path(4).exists()


def test_truncated_upload_is_refused(endpoint):
    with socket.create_connection(("127.0.0.1", endpoint.port)) as s:
        s.sendall(f"PUT /rollouts/5 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
                  f"Content-Length: 1000\r\n\r\n".encode() + b"x" * 10)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(4096):  # the server closes after its answer
            reply += chunk
        reply = reply.decode()
    assert " 400 " in reply.splitlines()[0] and "incomplete body" in reply
    assert not endpoint.inbox.path(5).exists() and not list(endpoint.inbox.root.iterdir())


def test_sender_waits_for_a_late_endpoint_and_resume_point(tmp_path):
    port = free_port()
    ep = TrainerEndpoint(tmp_path / "trainer", SECRET, "127.0.0.1", port)

    def late():
        time.sleep(1.0)
        ep.start()
        time.sleep(0.5)
        ep.set_base(2, 40)

    threading.Thread(target=late).start()

    async def go():
        client = TrainerClient(f"http://127.0.0.1:{port}", SECRET, deadline_s=30)
        await client.send_batch(a_batch(0))  # refused connections, then accepted
        point = await client.resume_point()  # 503 while loading, then the point
        await client.close()
        return point

    try:
        assert asyncio.run(go()) == (2, 40, [])
        assert ep.inbox.path(0).exists()
        # batches after the checkpoint stay for a replay: a restarted orchestrator continues after them
        for step, position in ((2, 48), (3, 56), (5, 99)):
            batch = a_batch(step)
            batch.data_position, batch.data_ahead = position, [position + 3]
            ep.inbox.send(batch)
        assert ep.resume() == {"step": 4, "data_position": 56, "data_ahead": [59]}  # the last one in a row
    finally:
        ep.stop()


def test_a_request_to_a_port_held_by_another_process_follows_the_endpoint_where_it_publishes(tmp_path):
    """The configured port is held by a process that accepts and never answers; the trainer, moved off it, starts
    later and publishes where it listens: a request sent to the holder goes there as soon as it is published,
    not after `hang_timeout_s` (300 s here), and no hang is reported."""
    from prl.transport import ports

    holder = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    taken = f"http://127.0.0.1:{holder.getsockname()[1]}"
    ep = TrainerEndpoint(tmp_path / "trainer", SECRET, "127.0.0.1", 0, name="trainer")
    hung: list[str] = []

    async def go():
        client = TrainerClient(taken, SECRET, hang_timeout_s=300, on_hang=hung.append,
                               locate=lambda: ports.url_of(tmp_path / "trainer", "trainer", taken))
        request = asyncio.ensure_future(client.resume_point())
        while not holder_connected():  # the request waits on the holder
            await asyncio.sleep(0.05)
        ep.start()  # publishes its port
        ep.set_base(3, 24)
        point = await asyncio.wait_for(request, 120)
        await client.close()
        return point, client.base_url

    def holder_connected() -> bool:
        holder.settimeout(0)
        try:
            conns.append(holder.accept()[0])
        except BlockingIOError:
            pass
        return bool(conns)

    conns: list[socket.socket] = []
    try:
        assert asyncio.run(go()) == ((3, 24, []), url(ep)) and not hung
    finally:
        ep.stop()
        for c in (*conns, holder):
            c.close()


def test_weights_long_poll_and_verified_fetch(endpoint, tmp_path):
    root = endpoint.weights_root
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    write_weights(root / "v1", state, {"version": 1})

    polling, latest, waits = threading.Event(), endpoint.latest, []

    def spy(after, wait_s):  # the endpoint's long poll for a version after 1 has begun
        waits.append(wait_s)
        if after == 1:
            polling.set()
        return latest(after, wait_s)

    endpoint.latest = spy

    def publish_later():
        polling.wait(60)
        write_weights(root / "v2", {k: v + 1 for k, v in state.items()}, {"version": 2})
        endpoint.sealed()  # as the trainer does after sealing a version

    async def poll():
        client = TrainerClient(url(endpoint), SECRET)
        now = await client.latest_version(after=-1, wait_s=5)
        newer = await client.latest_version(after=1, wait_s=120)
        for hang in (8.0, 120.0):  # a poll waits at most half the hang timeout, and 10 s: a stopped trainer is told
            quick = TrainerClient(url(endpoint), SECRET, hang_timeout_s=hang)  # from a poll within 1.5 x the timeout
            await quick.latest_version(after=-1)
            await quick.close()
        await client.close()
        return now, newer

    threading.Thread(target=publish_later).start()
    # v2 is written only once the endpoint polls for a version after 1: answering 2 means it waited
    assert asyncio.run(poll()) == (1, 2)
    assert waits == [5.0, 120.0, 4.0, 10.0], waits
    fetch = HttpFetch(url(endpoint), SECRET, tmp_path / "server_host" / "weights", keep=1)
    downloads, download = [], fetch._download
    fetch._download = lambda version, final: downloads.append(version) or download(version, final)
    got = fetch.fetch(2)
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(got / "model.safetensors"))["w"], state["w"] + 1)
    assert fetch.fetch(2) == got and downloads == [2], "already on this host: no second download"


def test_corrupt_transfer_is_retried_then_refused(endpoint, tmp_path):
    root = endpoint.weights_root
    path = write_weights(root / "v3", {"w": torch.randn(32, 32)}, {"version": 3})
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    fetch = HttpFetch(url(endpoint), SECRET, tmp_path / "server_host" / "weights")
    with pytest.raises(WeightFetchError) as e:
        fetch.fetch(3)
    assert "attempt 3" in str(e.value) and "sha256" in str(e.value)
    dest = tmp_path / "server_host" / "weights"
    assert not dest.exists() or not list(dest.iterdir()), "nothing half-copied is left behind"


def test_bad_numbers_answer_400_and_a_vanished_client_is_not_an_error(endpoint, capfd):
    import httpx

    headers = {"Authorization": f"Bearer {SECRET}"}
    for query in ("after=abc", "after=1&wait=nan", "wait=x"):
        r = httpx.get(f"{url(endpoint)}/weights/latest?{query}", headers=headers)
        assert r.status_code == 400 and "bad request" in r.text, (query, r.text)
    with socket.create_connection(("127.0.0.1", endpoint.port)) as s:  # httpx refuses to send this
        s.sendall(f"PUT /rollouts/1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
                  f"Content-Length: zz\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.0 400")
    # a long poll whose client disconnects (the orchestrator at shutdown): no traceback in the log
    s = socket.create_connection(("127.0.0.1", endpoint.port))
    s.sendall(f"GET /weights/latest?after=99&wait=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode())
    s.close()
    assert httpx.get(f"{url(endpoint)}/weights/latest?after=99&wait=1.5", headers=headers).status_code == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def corrupt(step: int, **change) -> bytes:
    from prl.transport.rollouts import batch_bytes

    batch = a_batch(step)
    mb = batch.micro_batches[0][0]
    for name, value in change.items():
        if name in ("step", "micro_batches"):
            setattr(batch, name, value)
        else:
            setattr(mb, name, value)
    return batch_bytes(batch)


def test_fuzz_sweep_of_the_trainer_endpoint(tmp_path):
    """Bad batches are refused with 400 naming what is wrong (they would crash every restart of the
    trainer); bad queries answer 4xx; nothing answers 5xx and the endpoint keeps working."""
    import httpx

    ep = TrainerEndpoint(tmp_path / "trainer", SECRET, "127.0.0.1", 0, world=2, vocab_size=100).start()
    try:
        c = httpx.Client(base_url=url(ep), headers={"Authorization": f"Bearer {SECRET}"}, timeout=30)
        n = len(a_batch(1).micro_batches[0][0].input_ids)
        bodies = {
            b"garbage": "not a prl batch",
            torch.tensor([1.0]).numpy().tobytes(): "not a prl batch",
            corrupt(9): "batch for step 9 sent as step 1",
            corrupt(1, micro_batches=[[]]): "packed for 1 ranks, the trainer has 2",
            corrupt(1, infer_logprobs=torch.full((n,), float("nan"))): "infer_logprobs holds non-finite values",
            corrupt(1, input_ids=torch.full((n,), 100)): "outside the vocabulary (100)",
            corrupt(1, target_ids=torch.full((n,), -3)): "target_ids must hold non-negative integers",
            corrupt(1, advantages=torch.zeros(n + 1)): "advantages has",
            corrupt(1, loss_mask=torch.zeros(2, n)): "loss_mask is not a 1-D tensor",
            corrupt(1, routing=torch.zeros(n, 3)): "routing must be",
        }
        for body, words in bodies.items():
            r = c.put("/rollouts/1", content=body)
            assert r.status_code == 400 and words in r.text, (words, r.status_code, r.text)
        assert not ep.inbox.path(1).exists()
        ep.set_base(0, 0)
        for path in ("/weights/latest?after=x", "/weights/latest?wait=nan", "/weights/latest?wait=inf",
                     "/weights/latest?after=99999999999999999999999&wait=0", "/weights/v99999999999999999999/x",
                     "/weights/v1/../../secret", "/rollouts/1", "/nothing", "/resume?x=1"):
            r = c.get(path)
            assert r.status_code < 500, (path, r.status_code, r.text)
        for path in ("/rollouts/-1", "/rollouts/x", "/rollouts/99999999999999999999999"):
            assert c.put(path, content=b"x").status_code in (400, 404)
        assert c.put("/rollouts/1", content=corrupt(1)).status_code == 200
    finally:
        ep.stop()


def test_finished_is_remembered_for_a_restarted_trainer_of_the_same_run(tmp_path):
    """The orchestrator's `PUT /finished` may come before the trainer waits for it, and before a fault restarts
    the trainer: the endpoint that follows still ends at once, unless the run was resumed with more steps."""
    ep = TrainerEndpoint(tmp_path / "trainer", SECRET, "127.0.0.1", 0, max_steps=6).start()

    async def finish():
        client = TrainerClient(url(ep), SECRET)
        await client.finished()
        await client.close()

    asyncio.run(finish())
    ep.wait_finished()
    ep.stop()
    again = TrainerEndpoint(tmp_path / "trainer", SECRET, "127.0.0.1", 0, max_steps=6)
    done = threading.Thread(target=again.wait_finished, daemon=True)
    done.start()
    done.join(timeout=30)
    again.server.server_close()
    assert not done.is_alive(), "a restarted trainer of the same run waits for nothing"
    # remembered for 6 steps: a run resumed with more waits for its orchestrator again
    assert (tmp_path / "trainer" / "orchestrator-finished").read_text() == "6"
