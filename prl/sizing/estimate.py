"""`prl plan RECIPE`: will the recipe fit, how long should a step take, and on what? (no torch)

The terms live in their own modules, each a small function with a hand-checked test:
`trainer` (trainer memory and step), `layouts` (serving layouts and one inference GPU's memory),
`kv` (KV bytes per token and where they live), `decode` (one decode step: bytes read, FLOPs,
exchanges, MTP), `rollout` (a layout's rollout per step, the weight update, trajectory latency),
`workload` (lengths, turns, environment tokens; Little's law and the staleness window), `lora`
(adapters on a frozen base: memory, GEMMs, the weight update), `compare` (LoRA against full
fine-tuning, and the split of the hosts), and `mechanisms` (built or planned, marked beside every
term). Every assumption is a `[plan]` key, printed with the result. The orchestrator runs ahead, so a step takes about max(trainer, rollout).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from prl.recipe.schema import Recipe
from prl.sizing import lora
from prl.sizing import trainer as tr
from prl.sizing.compare import LoraComparison, compare
from prl.sizing.layouts import Layout, candidates, describe, recipe_layout, weight_bytes
from prl.sizing.params import Counts, count
from prl.sizing.rollout import Rollout, collective, evaluate, weight_send_seconds, weights_moved
from prl.sizing.workload import Workload, async_cap, in_flight, steps_spanned, workload

GB = 1e9
BUILTIN = Path(__file__).with_name("glm5_config.json")
STEP = "step (async: the slower of the two)"


def model_config(recipe: Recipe) -> tuple[dict, str]:
    """The model's config.json: the folder's when it is on this machine, else (GLM-5 family) the
    GLM-5 defaults shipped with prl, else the tiny model the recipe builds."""
    m = recipe.model
    if m.path:
        cfg = Path(m.path).expanduser() / "config.json"
        if cfg.is_file():
            return json.loads(cfg.read_text()), str(cfg)
        if m.arch == "glm_moe_dsa":
            return json.loads(BUILTIN.read_text()), f"{BUILTIN.name} (GLM-5; {cfg} is not on this machine)"
        raise ValueError(f"prl plan: {cfg} is not on this machine; run prl plan where the model folder is")
    from prl.model.tiny import CHARS, SPECIALS, tiny_config

    return tiny_config(m, len(SPECIALS) + len(CHARS)).to_dict(), f"the tiny {m.arch} model of [model]"


@dataclass
class Plan:
    config_source: str
    counts: Counts
    world: int
    workload: Workload
    trainer: dict[str, float] = field(default_factory=dict)  # bytes per GPU, by item
    inference: dict[str, float] = field(default_factory=dict)  # the recipe's layout
    time: dict[str, float] = field(default_factory=dict)  # seconds
    uses: dict[str, tuple[str, ...]] = field(default_factory=dict)  # term -> mechanisms (prl.sizing.mechanisms)
    rollout: Rollout | None = None  # the recipe's layout
    layouts: list[Rollout] = field(default_factory=list)  # the candidates for its hardware
    best: Rollout | None = None
    flight: dict[str, float] = field(default_factory=dict)  # Little's law and the staleness window
    facts: dict[str, object] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # printed after the step times
    lora: LoraComparison | None = None  # with trainer.lora: LoRA against full fine-tuning


def serving_uses(recipe: Recipe, c: dict, layout: Layout) -> tuple[str, ...]:
    inf = recipe.inference
    extra = (("fp8_serving",) if inf.fp8 and inf.backend == "vllm" else ()) + \
        (("fp8_kv",) if inf.kv_cache_dtype == "fp8" else ()) + (("mtp",) if inf.mtp_tokens else ())
    return layout.mechanisms(c) + extra


def trainer_uses(recipe: Recipe, key: str) -> tuple[str, ...]:
    """The mechanisms a trainer time term relies on."""
    pl, layout = recipe.plan, getattr(recipe.trainer.parallel, "cp_layout", "contiguous")
    if key.startswith("sparse"):
        return ("checkpointing", "fused_dsa")
    if key.startswith("indexer"):
        return ("fused_dsa", layout)
    if "FP8" in key:
        return ("fp8_trainer",)
    if key.startswith("expert all-to-all"):
        return tuple(m for m, on in (("fp8_dispatch", pl.fp8_dispatch), ("node_dedup", pl.node_dedup)) if on)
    if key.startswith("CP"):
        return (layout,)
    if key.startswith("weight send"):
        return ("collective_weights" if collective(recipe) else "http_weights",)
    return ()


def trainer_terms(plan: Plan, recipe: Recipe, c: dict, w: Workload) -> None:
    """Trainer memory and time, each term with the mechanisms it uses."""
    n, world, par = plan.counts, plan.world, recipe.trainer.parallel
    plan.trainer = tr.trainer_memory(recipe, c, n, world)
    plan.uses.update({k: (("checkpointing", "fused_dsa") if k.startswith(("activations", "DSA")) else ())
                      + lora.term_uses(recipe, k) for k in plan.trainer})
    compute = tr.compute_seconds(recipe, c, n, w, world)
    comm = tr.comm_seconds(recipe, c, n, w, world)
    send = weight_send_seconds(recipe, c, n, plan.rollout.layout, world)
    terms = {**compute, **comm, "weight send to the servers": send}
    for k, v in terms.items():
        plan.time[f"trainer {k}"] = v
        plan.uses[f"trainer {k}"] = trainer_uses(recipe, k) + lora.term_uses(recipe, k)
    plan.time["trainer step"] = tr.step_seconds(recipe, compute, comm, send)
    plan.uses["trainer step"] = sum((plan.uses[f"trainer {k}"] for k in terms), ()) + \
        (("overlap",) if par.overlap and (par.ep > 1 or par.cp > 1) else ())
    if recipe.trainer.publish_overlap and not recipe.trainer.lora.enabled:
        plan.details.append(f"publishing in the background (trainer.publish_overlap): each rank copies its shards "
                            f"into host memory, {n.total * 4 / world / 1e9:.1f} GB a rank; the weight send runs "
                            f"beside the next step")
    layout = getattr(par, "cp_layout", "contiguous")
    idx = next((v for k, v in compute.items() if k.startswith("indexer")), 0.0) / tr.cp_imbalance(par.cp, layout)
    if par.cp > 1 and idx:
        plan.details.append(f"context parallelism (cp = {par.cp}): the busiest rank's indexer takes "
                            f"{minutes(idx * tr.cp_imbalance(par.cp, 'zigzag'))} a step with zigzag, "
                            f"{minutes(idx * tr.cp_imbalance(par.cp, 'contiguous'))} with contiguous slices "
                            f"(x{tr.cp_imbalance(par.cp, 'contiguous'):.3f}); the recipe uses {layout}")


def rollout_terms(plan: Plan, recipe: Recipe, c: dict) -> None:
    r = plan.rollout
    plan.inference = r.memory
    serving = serving_uses(recipe, c, r.layout)
    weights = ("collective_weights" if collective(recipe) else "http_weights",)
    plan.uses.update({k: serving for k in r.memory})
    for k, v in r.times.items():
        plan.time[f"rollout {k}"] = v
        plan.uses[f"rollout {k}"] = weights + lora.term_uses(recipe, k) if k == "weight update" else serving
    plan.details.append(update_detail(recipe, c, plan.counts, r.layout))
    plan.time["rollout step"] = r.seconds
    plan.uses["rollout step"] = serving + weights + lora.term_uses(recipe, "weight update")
    plan.time[STEP] = max(plan.time["trainer step"], r.seconds)
    plan.uses[STEP] = ("async",) + plan.uses["trainer step"] + plan.uses["rollout step"]


def update_detail(recipe: Recipe, c: dict, n: Counts, layout: Layout) -> str:
    moved, wb = weights_moved(recipe, c, n, layout), weight_bytes(recipe)
    how = (f"{'collectively from every trainer GPU' if collective(recipe) else 'files over HTTP from trainer rank 0'}"
           f" at plan.network_gb_s = {recipe.plan.network_gb_s:g} GB/s a GPU")
    if recipe.trainer.lora.enabled:
        return (f"weight update: {moved / 1e9:.2f} GB a step into the inference hosts: the LoRA adapters alone, fp32 "
                f"on the wire, every host all of them ({n.total * wb / 1e12:.2f} TB, the whole model, at v0 only), "
                f"{how}; each GPU merges them into its weights")
    return (f"weight update: {moved / 1e12:.2f} TB a step into the inference hosts (the model is "
            f"{n.total * wb / 1e12:.2f} TB at {wb:.0f} B a parameter; non-expert weights go to every host, redundant "
            f"expert slots too), {how}")


def flight_terms(plan: Plan, recipe: Recipe) -> None:
    """Little's law at the planned step, and the staleness window that follows."""
    r, w, step = plan.rollout, plan.workload, plan.time[STEP]
    need = in_flight(w.batch / step, r.latency)
    plan.flight = {"trajectory latency, mean (s)": r.latency, "trajectory latency, p99 (s)": r.latency_p99,
                   "in flight needed (Little's law)": need, "in flight the KV holds": r.fits * r.layout.replicas,
                   "in flight allowed (max_async_level, max_inflight_rollouts)": async_cap(recipe),
                   "rl.max_async_level needed": max(0, math.ceil(need / w.batch - 1e-9) - 1),
                   "rl.max_off_policy_steps needed": steps_spanned(r.latency_p99, step)}
    rl = recipe.rl
    if rl.max_async_level < plan.flight["rl.max_async_level needed"]:
        plan.notes.append(f"rl.max_async_level = {rl.max_async_level} lets {async_cap(recipe)} trajectories be in "
                          f"flight; a {step / 60:.1f}-min step needs {need:.0f} (Little's law): the rollout is "
                          f"throttled (its time above counts it); set {plan.flight['rl.max_async_level needed']}")
    if rl.max_off_policy_steps < plan.flight["rl.max_off_policy_steps needed"]:
        plan.notes.append(f"a p99 trajectory ({r.latency_p99 / 60:.0f} min) spans "
                          f"{plan.flight['rl.max_off_policy_steps needed']} steps; rl.max_off_policy_steps = "
                          f"{rl.max_off_policy_steps} applies rl.stale_policy to its oldest tokens")


def memory_problems(plan: Plan, recipe: Recipe) -> None:
    usable = recipe.plan.gpu_memory_gb * recipe.plan.memory_headroom * GB
    need = sum(plan.trainer.values())
    if need > usable:
        top = max(plan.trainer, key=plan.trainer.get)
        plan.problems.append(f"a trainer GPU needs {need / GB:.1f} GB, more than the {usable / GB:.1f} GB usable "
                             f"(plan.gpu_memory_gb x plan.memory_headroom); largest item: {top} "
                             f"{plan.trainer[top] / GB:.1f} GB")
    r = plan.rollout
    if r.fits < 1:
        plan.problems.append(f"an inference GPU ({r.layout.name}) has no room for one sequence's KV after its "
                             f"weights and runtime memory")
    elif r.fits < recipe.inference.max_batch_size:
        per = "server" if r.layout.dp == 1 else "attention replica (one per GPU)"
        plan.problems.append(f"the {r.layout.name} layout does not hold its KV: a {per} holds {r.fits:.1f} sequences "
                             f"of the mean in-flight length ({plan.workload.inflight_context / 1e3:.1f}k tokens); the "
                             f"recipe asks for {recipe.inference.max_batch_size} (inference.max_batch_size)")


def make_plan(recipe: Recipe) -> Plan:
    c, source = model_config(recipe)
    n, w = count(c), workload(recipe)
    plan = Plan(source, n, recipe.trainer_world(), w)
    plan.rollout = evaluate(recipe, c, n, recipe_layout(recipe), w, plan.world)
    plan.layouts = [evaluate(recipe, c, n, lay, w, plan.world, capped=False) for lay in candidates(recipe)]
    plan.layouts += pd_variant(recipe, c, n, w, plan)
    holding = [r for r in plan.layouts if r.fits >= 1]
    plan.best = min(holding, key=lambda r: r.seconds) if holding else None
    trainer_terms(plan, recipe, c, w)
    rollout_terms(plan, recipe, c)
    flight_terms(plan, recipe)
    memory_problems(plan, recipe)
    if recipe.trainer.lora.enabled:
        plan.lora = compare(recipe, c, n, w, plan.world, plan.rollout.layout)
    if plan.best is not None and plan.best.layout.name != plan.rollout.layout.name:
        plan.notes.append(f"the recipe serves with {plan.rollout.layout.name}; {plan.best.layout.name} is faster "
                          f"({plan.best.seconds / 60:.2f} against {plan.rollout.seconds / 60:.2f} min of rollout a step)")
    plan.facts = {"tokens per step": w.batch * w.mean, "inference engines": plan.rollout.layout.engines,
                  "attention replicas": plan.rollout.layout.replicas}
    return plan


def pd_variant(recipe: Recipe, c: dict, n: Counts, w: Workload, plan: Plan) -> list[Rollout]:
    """Separate pools: one host prefills (DP + EP over its GPUs), the others decode as one engine."""
    lay = next((r.layout for r in plan.layouts if r.layout.dp > 1 and r.layout.engines == 1), None)
    if lay is None or lay.hosts < 2:
        return []
    hosts = lay.hosts - 1
    decode = Layout(f"P/D: 1 prefill host, {describe(lay.per_host * hosts, lay.per_host * hosts, hosts)}", 1, hosts,
                    lay.per_host * hosts, lay.per_host * hosts, True, 1)
    return [evaluate(recipe, c, n, decode, w, plan.world, capped=False)]


def minutes(s: float) -> str:
    return f"{s / 60:.2f} min" if s >= 60 else f"{s:.2f} s"


def summary(plan: Plan) -> str:
    verdict = "DOES NOT FIT" if plan.problems else "fits"
    return (f"prl plan: {verdict}; trainer GPU {sum(plan.trainer.values()) / GB:.1f} GB, inference GPU "
            f"{sum(plan.inference.values()) / GB:.1f} GB, step about {minutes(plan.time[STEP])} "
            f"(`prl plan RECIPE` for the breakdown and assumptions)")
