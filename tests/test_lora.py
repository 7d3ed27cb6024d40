"""LoRA RL: the adapters' forward is the merged weights' forward (trainer and embedded engine), an adapter
version is refused whole when it does not fit and its base stays published; and one real run on the
embedded engine, its adapters over the collective path, its trainer killed mid-run: only the adapters
train, the checkpoints and versions after step 0 hold them alone, and the restarted trainer replays
to the same losses."""

import copy
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from prl.model.lora import AdapterBase, adapter_params, adapters_off, apply_lora, is_adapter, merged, wire_state
from prl.recipe.schema import ModelCfg

GROUPS = ["attention", "mlp", "shared_experts"]


def lora_model(arch: str, tmp_path: Path, rank: int = 4, alpha: float = 8.0, groups=GROUPS):
    """(the base model, a copy with adapters whose B is random: a step-0 adapter would change nothing)."""
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir

    base = build_model(write_model_dir(ModelCfg(arch=arch, num_layers=2, first_dense_layers=1), tmp_path / arch), seed=0)
    model = copy.deepcopy(base)
    targets = apply_lora(model, arch, rank, alpha, 0.0, groups, seed=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapter_params(model).items():
            if name.endswith("lora_B"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return base.eval(), model.eval(), targets


def published(model, scale: float) -> dict[str, torch.Tensor]:
    return wire_state({k: v.detach().clone() for k, v in adapter_params(model).items()}, scale)


IDS = torch.tensor([[5, 9, 3, 14, 7, 22, 8, 11, 4, 6]])


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "qwen3_moe"])
@pytest.mark.parametrize("routed", [False, True])
def test_the_adapters_forward_is_the_merged_weights_forward(arch, routed, tmp_path):
    """Dense targets, and the stacked routed experts' per-expert adapters (A [E, r, in], B [E, out, r])."""
    base, model, targets = lora_model(arch, tmp_path, groups=GROUPS + ["routed_experts"] * routed)
    assert any(".self_attn." in t for t in targets) and any(".mlp." in t for t in targets)
    assert not any("kv_b_proj" in t or "indexer" in t for t in targets)
    assert any(t.endswith("mlp.experts") for t in targets) == routed
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapter_params(model))
    with torch.no_grad():
        lora_logits = model(IDS).logits
        base.load_state_dict(merged(base.state_dict(), published(model, 8.0 / 4)), strict=False)
        merged_logits = base(IDS).logits
    torch.testing.assert_close(lora_logits, merged_logits, atol=2e-5, rtol=1e-5)


def test_a_fresh_adapter_changes_nothing(tmp_path):
    from prl.model.build import build_model
    from prl.model.tiny import write_model_dir

    base = build_model(write_model_dir(ModelCfg(num_layers=2), tmp_path / "m"), seed=0).eval()
    model = copy.deepcopy(base)
    apply_lora(model, "glm_moe_dsa", 8, 32.0, 0.0, GROUPS)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, base(IDS).logits)


def write_versions(root: Path, base_state: dict, adapter: dict) -> None:
    from prl.model.weights import write_weights

    write_weights(root / "v0", base_state, {"version": 0, "format": "memory"})
    write_weights(root / "v1", adapter, {"version": 1, "format": "memory", "adapter": {"base": 0, "rank": 4}})


def test_the_engine_serves_base_plus_adapter_and_refuses_one_that_does_not_fit(tmp_path):
    """v0 whole, v1 the adapters alone: the engine's model after v1 gives the adapters' forward; an adapter of
    the wrong shape, one with no base to merge into, or one with a NaN is refused before anything is touched."""
    from prl.inference.engine import WeightLoadError, prepare_weights
    from prl.model.weights import write_weights

    base, model, _ = lora_model("glm_moe_dsa", tmp_path)
    engine_model = copy.deepcopy(base)
    with torch.no_grad():  # a server started on other weights (restarted mid-run): it is sent the whole base
        for p in engine_model.parameters():
            p.add_(0.01)
    root = tmp_path / "weights"
    adapter = published(model, 2.0)
    write_versions(root, base.state_dict(), adapter)
    source = AdapterBase(lambda v: root / f"v{v}")
    policy = prepare_weights(engine_model, root / "v1", source)
    targets = {k.replace(".lora_A", ".weight") for k in adapter if k.endswith("lora_A")}
    assert set(policy.state) == set(base.state_dict())  # the whole base under the merged targets
    policy.load_into(engine_model)
    with torch.no_grad():
        torch.testing.assert_close(engine_model(IDS).logits, model(IDS).logits, atol=2e-5, rtol=1e-5)
        served = engine_model(IDS).logits
    # an adapter leaving out a target the last one changed: that target goes back to the base
    fewer = {k: v for k, v in adapter.items() if ".layers.0." not in k}
    write_weights(root / "v2", fewer, {"version": 2, "format": "memory", "adapter": {"base": 0, "rank": 4}})
    policy = prepare_weights(engine_model, root / "v2", source)
    assert set(policy.state) == targets  # the engine holds the base now: the targets alone
    policy.load_into(engine_model)
    base_state = base.state_dict()
    assert all(torch.equal(engine_model.state_dict()[k], base_state[k]) for k in base_state if ".layers.0." in k)
    served = engine_model(IDS).logits.detach()
    name = next(k for k in adapter if k.endswith("lora_B"))
    bad = {"shape": {**adapter, name: adapter[name][:, :2]},
           "nan": {**adapter, name: adapter[name] * float("nan")}}
    for state in bad.values():
        write_weights(root / "v2", state, {"version": 2, "format": "memory", "adapter": {"base": 0, "rank": 4}})
        with pytest.raises(WeightLoadError, match="adapter refused"):
            prepare_weights(engine_model, root / "v2", AdapterBase(lambda v: root / f"v{v}"))
    write_weights(root / "v3", adapter, {"version": 3, "format": "memory", "adapter": {"base": 9, "rank": 4}})
    with pytest.raises(WeightLoadError, match="base v9"):
        prepare_weights(engine_model, root / "v3", AdapterBase(lambda v: root / f"v{v}"))
    with torch.no_grad():
        assert torch.equal(engine_model(IDS).logits, served)


def test_pruning_keeps_the_base_of_the_adapters_it_keeps(tmp_path):
    from prl.model.weights import prune_versions, published_versions, write_weights

    t = {"w": torch.zeros(2)}
    write_weights(tmp_path / "v0", t, {"version": 0})
    for v in range(1, 6):
        write_weights(tmp_path / f"v{v}", t, {"version": v, "adapter": {"base": 0, "rank": 1}})
    prune_versions(tmp_path, 2)
    assert published_versions(tmp_path) == [0, 4, 5]


# ---------------------------------------------------------------- one real run
LORA = ROOT / "recipes" / "reverse-tiny-lora.toml"


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """reverse-tiny-lora, 40 steps, adapters over the collective path, full-format checkpoints every 4 steps;
    its trainer SIGKILLed three steps past a checkpoint."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_faults import STEPS, check_ledger, start, three_steps_past_a_checkpoint, trainer_rank, wait_for
    from test_run import assert_nothing_left

    tmp = tmp_path_factory.mktemp("lora")
    proc = start(tmp, "--set", 'trainer.weight_transfer="collective"', "--set", 'trainer.checkpoint_format="full"',
                 "--set", "trainer.keep_weights=2", recipe=LORA)
    run_dir = tmp / "reverse-tiny-lora"
    wait_for(run_dir, proc, three_steps_past_a_checkpoint(6))
    os.kill(trainer_rank(run_dir), signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    check_ledger(run_dir, STEPS)  # every step once, each on its batch; the reward is bench/lora.py's business
    assert_nothing_left(run_dir)
    return run_dir


@pytest.mark.slow
def test_a_killed_lora_trainer_replays_its_steps_to_the_same_losses(killed_run):
    from test_faults import check_trainer_restart

    check_trainer_restart(killed_run)


@pytest.mark.slow
def test_only_the_adapters_train_and_travel(killed_run):
    """Checkpoints after step 0 hold the adapters and an optimizer over them alone; versions after v0 are the
    adapters (sent over the collective), v0 is the step-0 base and survives pruning."""
    from safetensors.torch import load_file

    from prl.model.weights import read_weights

    ckpts = killed_run / "checkpoints"
    base = load_file(str(ckpts / "step_0" / "model.safetensors"))
    last = max(int(p.name.split("_")[1]) for p in ckpts.glob("step_*"))
    saved = load_file(str(ckpts / f"step_{last}" / "model.safetensors"))
    adapters = {k: v for k, v in saved.items() if is_adapter(k)}
    assert adapters and not any(map(is_adapter, base))
    assert all(torch.equal(v, base[k]) for k, v in saved.items() if k not in adapters)  # buffers (router bias)
    optim = torch.load(ckpts / f"step_{last}" / "optim.pt", weights_only=False)
    assert len(optim["state"]) == len(adapters)
    assert json.loads((ckpts / f"step_{last}" / "MANIFEST.json").read_text())["lora"]["rank"] == 8
    v0, m0 = read_weights(killed_run / "weights" / "v0")
    assert "adapter" not in m0 and all(torch.equal(v0[k], base[k]) for k in base)
    versions = sorted(int(p.name[1:]) for p in (killed_run / "weights").glob("v*"))
    assert versions[0] == 0 and len(versions) == 3  # the base, then the newest keep_weights = 2
    state, manifest = read_weights(killed_run / "weights" / f"v{versions[-1]}")
    assert manifest["adapter"] == {"base": 0, "rank": 8} and set(state) == set(adapters)
    sent = [e for e in map(json.loads, (killed_run / "metrics.jsonl").read_text().splitlines())
            if e["kind"] == "weights_sent" and e["version"] > 0]
    assert sent and all(e["error"] is None and e["servers"] == 1 for e in sent[-5:])
    assert max(e["bytes"] for e in sent) < sum(v.numel() * 4 for v in base.values()) / 10


# ---------------------------------------------------------------- an adapter's sender killed mid-version
def adapter_for(run_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """Adapters (published form) for the served model of `run_dir`, B drawn from `seed`."""
    from prl.model.build import build_model

    model = build_model(run_dir / "model", seed=0)
    apply_lora(model, "glm_moe_dsa", 4, 8.0, 0.0, GROUPS, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter_params(model).items():
            if name.endswith("lora_B"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return published(model, 2.0)


def send_adapter(sink, version: int, adapter: dict, stop_after: int | None = None) -> None:
    from prl.trainer.publish import buckets

    sink.begin(version)
    for b, names in enumerate(buckets(list(adapter))):
        sink.put({n: adapter[n] for n in names})
        if b + 1 == stop_after:
            print(len(names), flush=True)
            __import__("time").sleep(600)  # killed here, mid-version
    sink.seal({"version": version, "format": "memory", "adapter": {"base": 0, "rank": 4}})


ADAPTER_SENDER = """
import sys
sys.path.insert(0, sys.argv[4])
from pathlib import Path
from test_collective import sink_for
from test_lora import adapter_for, send_adapter
run_dir = Path(sys.argv[1])
send_adapter(sink_for(run_dir, sys.argv[2], sys.argv[3]), 2, adapter_for(run_dir, 2), stop_after=1)
"""


def test_an_adapter_senders_death_mid_version_leaves_the_last_adapter_serving(tmp_path):
    """Base v0 whole, adapter v1 over the collective (served, merged); v2's sender killed after its first
    bucket: v2 is refused, v1 keeps serving."""
    from conftest import start_server
    from prl.model.weights import write_weights
    from prl.recipe.schema import Recipe
    from test_collective import greedy, kill_sender_mid_version, sink_for, state_for

    proc, cfg, client = start_server(tmp_path, Recipe.model_validate({}))
    url, secret = f"http://{cfg.host}:{cfg.port}", cfg.secret()
    try:
        write_weights(tmp_path / "weights" / "v0", state_for(tmp_path, 0), {"version": 0, "format": "memory"})
        assert client.post("/update_weights", json={"version": 0}).status_code == 200
        base_lp = greedy(client)
        sink = sink_for(tmp_path, url, secret)
        send_adapter(sink, 1, adapter_for(tmp_path, 1))
        assert sink.last.error is None and sink.last.servers == 1, sink.last
        assert client.post("/update_weights", json={"version": 1}).json()["source"] == "collective"
        v1_lp = greedy(client)
        assert v1_lp != base_lp
        kill_sender_mid_version(client, ADAPTER_SENDER, tmp_path, url, secret)
        r = client.post("/update_weights", json={"version": 2})
        assert r.status_code == 409 and "still serving v1" in r.json()["detail"]
        assert greedy(client) == v1_lp
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def test_a_tiny_models_lora_targets_are_refused_where_they_select_nothing(tmp_path):
    """The launch's recipe checks refuse a tiny model's targets exactly where `target_modules` finds none, for
    every family, dense-layer count and set of groups."""
    import itertools

    from prl.launch.checks import check_recipe
    from prl.model.build import build_model
    from prl.model.lora import target_modules
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import LORA_GROUPS, Recipe

    wrong = []
    for arch, dense in itertools.product(["glm_moe_dsa", "qwen3_moe"], [0, 1, 2]):
        m = {"arch": arch, "num_layers": 2, "first_dense_layers": dense}
        model = build_model(write_model_dir(ModelCfg(**m), tmp_path / f"{arch}{dense}"), seed=0)
        for groups in (list(g) for r in range(1, 5) for g in itertools.combinations(LORA_GROUPS, r)):
            try:
                check_recipe(Recipe.model_validate({"model": m, "trainer": {"lora": {"rank": 4, "targets": groups}}}))
                valid = True
            except ValueError:
                valid = False
            if valid != bool(target_modules(model, arch, groups)):
                wrong.append((arch, dense, groups, valid))
    assert not wrong


def test_a_recipe_whose_lora_targets_select_nothing_is_refused_by_name():
    from prl.launch.checks import check_recipe, not_built
    from prl.recipe.schema import Recipe

    with pytest.raises(ValueError, match="trainer.lora.targets .* has no module in these groups"):
        check_recipe(Recipe.model_validate({"model": {"arch": "qwen3_moe"},
                                            "trainer": {"lora": {"rank": 4, "targets": ["shared_experts"]}}}))
    with pytest.raises(ValueError, match="trainer.lora.targets .* has no module in these groups"):  # no MoE layer
        check_recipe(Recipe.model_validate({"model": {"first_dense_layers": 3},
                                            "trainer": {"lora": {"rank": 4, "targets": ["shared_experts"]}}}))
    with pytest.raises(ValueError, match="a non-empty list of distinct groups"):
        Recipe.model_validate({"trainer": {"lora": {"rank": 4, "targets": ["attention", "attention"]}}})
    assert not_built(Recipe.model_validate({"trainer": {"lora": {"rank": 4, "targets": ["routed_experts"]}}})) == []


# ---------------------------------------------------------------- the KL reference of a LoRA run under R3
@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_lora_reference_routes_by_itself_under_replay(tmp_path, monkeypatch, one_rank):
    """The reference of a LoRA run is the policy's model, adapters off: under R3 it routes every token itself
    (the replayed routes, drawn at random, differ from the router's), so its logprobs are a fresh forward of the
    base without replay, and `routing_agreement` counts the policy's forward alone."""
    from prl.model.families import routed_experts
    from prl.model.policy import LoraPolicy
    from prl.model.routing import Replay, routers
    from prl.recipe.schema import TrainerCfg
    from prl.trainer import head, step
    from prl.transport.batch import pack, rows_by_sample
    from test_shared_prompts import groups

    base, model, _ = lora_model("qwen3_moe", tmp_path)
    model.train()  # dropout 0: train mode changes nothing but what the trainer runs in
    for m in (base, model):
        head.install(m)
    replay = Replay(model, replay=True)
    cfg = model.config
    samples = groups(len(routers(model)), routed_experts(cfg.to_dict()), cfg.num_experts_per_tok)
    [mbs] = pack(samples, 1, 64)
    tcfg = TrainerCfg.model_validate({"loss": {"kl_coef": 0.1}})
    seen = []

    def spy(logp, mb, loss_cfg, entropy=None, ref=None, **kw):
        seen.append(ref.clone())
        return real(logp, mb, loss_cfg, entropy, ref, **kw)

    real = step.rl_loss
    monkeypatch.setattr(step, "rl_loss", spy)
    reference = LoraPolicy(tcfg.lora.model_copy(update={"rank": 4})).reference(model)  # the trainer's
    stats = step.forward_backward(model, replay, mbs, "rl", tcfg, 1.0, torch.device("cpu"), reference=reference)
    ids = 0
    with torch.no_grad():
        for mb, ref in zip(mbs, seen, strict=True):
            rows, width = rows_by_sample(mb, cfg.hidden_size)
            fresh = step.token_outputs(base, rows, width, None, 1.0, tcfg.logprob_chunk_tokens)[:, 0]
            torch.testing.assert_close(ref, fresh, atol=1e-5, rtol=1e-5)
            with replay.use(rows.routing):
                step.token_outputs(model, rows, width, None, 1.0, tcfg.logprob_chunk_tokens)
            agreed, n = replay.agreement()
            ids += n
            with replay.use(rows.routing), adapters_off(model):  # what the reference gave before: replayed routes
                replayed = step.token_outputs(model, rows, width, None, 1.0, tcfg.logprob_chunk_tokens)[:, 0]
            replay.agreement()
            assert not torch.allclose(replayed, fresh, atol=1e-3)  # so the first check can fail
    assert stats["routing_ids"] == ids and stats["routing_agreed"] < ids


def test_every_adapter_of_a_48_layer_model_starts_from_its_own_values(tmp_path):
    """Each target's A is drawn from the run's seed and a stable hash of its name: layers whose numbers hold the
    same digits (12, 21, 30 ...) get A of their own, and a second build draws the same values."""
    from prl.model.build import build_model
    from prl.model.lora import init_adapters
    from prl.model.tiny import write_model_dir

    model = build_model(write_model_dir(ModelCfg(num_layers=48, first_dense_layers=3), tmp_path / "m"), seed=0)
    targets = apply_lora(model, "glm_moe_dsa", 2, 4.0, 0.0, GROUPS, seed=5)
    a = {n: p.detach().clone() for n, p in adapter_params(model).items() if n.endswith("lora_A")}
    assert len(a) == len(targets) and any(".layers.47." in n for n in a)
    firsts = {}
    for name, t in a.items():
        key = (tuple(t.shape), float(t.flatten()[0]))
        assert key not in firsts or not torch.equal(a[firsts[key]], t), f"{name} starts as {firsts[key]}"
        firsts[key] = name
    init_adapters(model, 5)
    assert all(torch.equal(p, a[n]) for n, p in adapter_params(model).items() if n in a)
    # every process draws the same: a fixed function of seed and name (Python's hash() is salted per process)
    from prl.model.lora import adapter_seed

    assert adapter_seed(5, "model.layers.12.self_attn.q_a_proj.lora_A") == 9550780253629997597


@pytest.mark.parametrize("fp8", [False, True])
def test_the_frozen_base_is_held_at_trainer_dtype(tmp_path, one_rank, fp8):
    """As docs/lora.md says: the trainer holds the frozen base at trainer.dtype (bf16 here), under trainer.fp8
    too (its FP8 layers quantise that copy as they compute; no FP8 base is held), and the adapters in fp32."""
    from prl.model.fp8 import Fp8BlockLinear
    from prl.model.lora import lora_modules
    from prl.model.policy import policy_for
    from prl.model.tiny import write_model_dir
    from prl.recipe.schema import TrainerCfg
    from prl.trainer.model_setup import setup_model

    tcfg = TrainerCfg.model_validate({"dtype": "bfloat16", "fp8": fp8, "lora": {"rank": 4}})
    dims = tcfg.parallel.dims(1)
    dims.build_meshes("cpu")
    built = setup_model(write_model_dir(ModelCfg(num_layers=2), tmp_path / "m"), tcfg, dims, torch.device("cpu"),
                        policy=policy_for(tcfg.lora))
    model = built.par.model
    held = {n: p.dtype for n, p in model.named_parameters()}
    assert {held[n] for n in adapter_params(model)} == {torch.float32}
    assert {d for n, d in held.items() if not is_adapter(n)} == {torch.bfloat16}
    assert any(isinstance(m, Fp8BlockLinear) for m in lora_modules(model)) == fp8 and bool(built.fp8.get("fp8")) == fp8
