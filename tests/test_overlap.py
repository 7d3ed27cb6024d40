"""The trainer's exchanges overlapped with its compute, over hosts joined by a shaped network
(tests/shaped_net.py: namespace hosts, every port's bandwidth limited by tc's token bucket), so each
exchange waits on a wire. tests/dist_overlap.py runs the steps; tests/test_ep_dispatch.py compares
overlapped and serial steps on one host (FP8 dispatch, node dedup, checkpointing), test_parallel.py
cp 2 x ep 2 against one rank."""

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from shaped_net import ShapedLink, available, torchrun
from test_parallel import assert_same_step

from prl.model.tiny import write_model_dir
from prl.recipe.schema import ModelCfg
from prl.trainer.overlap import Clock

HERE = Path(__file__).parent
pytestmark = pytest.mark.skipif(available() is not None, reason=f"a shaped network {available()}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "model"
    write_model_dir(ModelCfg(num_experts=8, experts_per_token=2, num_layers=2, first_dense_layers=0), d)
    return d


def spec(steps: int, timeout_s: int = 600, **parallel) -> str:
    case = {"parallel": {"ep": 2, **parallel}, "activation_checkpointing": True}
    serial = {**case, "parallel": {**case["parallel"], "overlap": False}}
    return json.dumps({"cases": {"overlap": case, "serial": serial}, "steps": steps, "samples": 8, "length": 24,
                       "timeout_s": timeout_s})


def test_overlapped_steps_equal_serial_ones_over_a_shaped_link(model_dir, tmp_path):
    """Two hosts, one rank each, 200 Mbit/s each way: ep 2 with checkpointing, overlapped and serial,
    give the same step (loss, every gradient, the weights after AdamW); every step's exchanges were in
    flight for some time, and the time waited for them is within it."""
    out = tmp_path / "steps.pt"
    with ShapedLink(2, 200) as link, torchrun(link, HERE / "dist_overlap.py",
                                              [str(model_dir), str(out), spec(2, overlap_chunks=3)]) as procs:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-2000:]
    run = torch.load(out, weights_only=False)
    assert_same_step(run["serial"], run["overlap"], "overlapped against serial over a shaped link")
    assert all(c > 0 for case in run.values() for c in case["comm_s"])
    exposed = {name: sum(case["exposed_comm_s"]) / sum(case["comm_s"]) for name, case in run.items()}
    # serial waits for each exchange as it is issued; overlapped, compute runs while rows are on the wire
    assert exposed["serial"] > 0.8 and exposed["overlap"] < exposed["serial"] - 0.15, exposed


def test_a_rank_killed_mid_exchange_fails_the_step_without_hanging(model_dir, tmp_path):
    """At 20 Mbit/s most of a step is exchanges: host b's rank killed once steps run leaves host a's
    rank waiting on one; it fails with gloo's closed connection (the trainer's supervisor then restarts
    the trainer, tests/test_faults.py), at the latest at the process group's timeout (30 s here: where
    the close never reaches it, seen once in FSDP's gather), never hanging past it."""
    with ShapedLink(2, 20) as link, torchrun(link, HERE / "dist_overlap.py",
                                             [str(model_dir), str(tmp_path / "x.pt"), spec(200, 30)]) as procs:
        first = procs[0].stdout.readline
        while not (line := first()).startswith("step 1"):
            assert line, "rank 0 ended before its second step"
        worker = subprocess.run(["pgrep", "-P", str(procs[1].pid), "-f", "dist_overlap.py"], capture_output=True, text=True)
        assert worker.stdout.split(), "host b's rank"
        subprocess.run(["kill", "-9", *worker.stdout.split()], check=True)
        killed = time.monotonic()
        rest = procs[0].communicate(timeout=300)[0]
        procs[1].wait(timeout=60)
    assert procs[0].returncode != 0, rest[-2000:]
    assert any(w in rest for w in ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")), \
        rest[-3000:]
    print(f"rank 0 failed {time.monotonic() - killed:.1f} s after its peer was killed")


def test_the_clock_counts_time_in_flight_once_and_waits_within_it():
    clock = Clock()
    for span in ((0.0, 1.0), (0.5, 1.5), (3.0, 4.0)):
        clock.span(*span)
    clock.wait(0.2)
    assert clock.figures() == (2.5, 0.2)
    clock.wait(5.0)
    assert clock.figures() == (2.5, 2.5), "never more waited than in flight"
    clock.reset()
    assert clock.figures() == (0.0, 0.0) and clock.forward_figures() is None


def test_the_clock_splits_the_first_forward_from_its_backward():
    """`mark` (a backward starts): the forward's figures are the exchanges issued before it and the waits by then."""
    clock = Clock()
    t = clock.started
    clock.span(t, t + 1.0)  # issued in the forward, done whenever
    clock.wait(0.25)
    clock.mark()
    clock.span(clock.marks[0][0] + 1.0, clock.marks[0][0] + 3.0)  # the backward's
    clock.wait(1.0)
    wall, comm, waited = clock.forward_figures()
    assert wall == clock.marks[0][0] - t and (comm, waited) == (1.0, 0.25)
    assert clock.figures() == (3.0, 1.25)


def test_token_chunks_are_as_many_whatever_the_tokens():
    """Every rank runs one exchange per chunk: a rank with fewer tokens than chunks gets empty ones."""
    from prl.trainer.ep_dispatch import token_chunks

    ids, w = torch.arange(6).view(3, 2), torch.ones(3, 2)
    chunks = token_chunks(ids, w, 4)
    assert [(a, c.shape[0]) for a, c, _ in chunks] == [(0, 0), (0, 1), (1, 1), (2, 1)]
    assert torch.equal(torch.cat([c for _, c, _ in chunks]), ids)
    assert [c.shape[0] for _, c, _ in token_chunks(ids[:0], w[:0], 4)] == [0, 0, 0, 0]


def test_every_rank_is_killed_when_the_block_is_left(tmp_path):
    """A wait that times out inside `torchrun`'s block leaves no torchrun and no rank running (each rank is
    in a session of its own, so killing torchrun's group alone would leave them)."""
    from shaped_net import descendants

    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    with ShapedLink(2, 200) as link:
        with pytest.raises(subprocess.TimeoutExpired), torchrun(link, script, []) as procs:
            while not all(any(sleeper(p) for p in descendants(proc.pid)) for proc in procs):
                time.sleep(0.2)
            started = [pid for proc in procs for pid in [proc.pid, *descendants(proc.pid)]]
            procs[0].communicate(timeout=1)
    alive = [pid for pid in started if Path(f"/proc/{pid}").exists() and "Z" not in state(pid)]
    assert alive == [], alive


def sleeper(pid: int) -> bool:
    try:
        return b"sleeper.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
