"""`prl plan`'s text: every term with its value, its mark (built / planned) and its assumption."""

from __future__ import annotations

from prl.recipe.schema import Recipe
from prl.sizing.compare import Split
from prl.sizing.estimate import GB, Plan, minutes
from prl.sizing.mechanisms import BUILT, MECHANISMS, mark
from prl.sizing import trainer as tr
from prl.sizing.rollout import Rollout


# the [plan] keys each step-time term depends on, beyond the recipe's own settings
ASSUMES = {
    "trainer GEMMs in FP8": "fp8_tflops, mfu, expert_imbalance", "trainer GEMMs": "gpu_tflops, mfu, expert_imbalance",
    "trainer sparse attention": "gpu_tflops, mfu, lengths", "trainer indexer": "gpu_tflops, mfu, lengths",
    "trainer expert all-to-all": "network_gb_s, nvlink_gb_s, expert_imbalance, fp8_dispatch, node_dedup",
    "trainer FSDP": "network_gb_s", "trainer CP": "nvlink_gb_s, network_gb_s", "trainer weight send": "network_gb_s",
    "trainer step": "overlap_efficiency",
    "rollout decode": "hbm_tb_s, decode_efficiency, mfu, mtp_acceptance, expert_imbalance, network_gb_s, "
                      "collective_latency_us, lengths",
    "rollout prefill": "fp8_tflops, mfu, prompt_tokens, env_tokens_per_turn",
    "rollout weight update": "network_gb_s, nvlink_gb_s",
}


def assumes(term: str) -> str:
    keys = next((v for k, v in ASSUMES.items() if term.startswith(k)), "")
    return f"  (plan: {keys})" if keys else ""


def workload_lines(recipe: Recipe, plan: Plan) -> list[str]:
    w, pl = plan.workload, recipe.plan
    return [f"workload ('lengths' below; assumptions): prompt {w.prompt:,.0f} tokens, {w.model:,.0f} model tokens a trajectory "
            f"(plan.completion_fraction {pl.completion_fraction} of the budget), {w.turns:g} turn(s), {w.env:,.0f} "
            f"environment tokens and {w.env_seconds:g} s in tools a trajectory; p99 trajectory {w.p99:,.0f} tokens; "
            f"lengths log-normal (sigma {w.sigma:.2f}): token-weighted mean {w.token_weighted / 1e3:.1f}k, mean KV "
            f"of a trajectory in flight {w.inflight_context / 1e3:.1f}k; {w.batch} trajectories a step "
            f"({w.batch // w.group} prompts x {w.group})"]


def memory_lines(title: str, items: dict[str, float], plan: Plan, usable: float) -> list[str]:
    need = sum(items.values())
    left = "the KV cache takes what is left" if plan.inference is items else f"headroom {(usable - need) / GB:.1f} GB"
    lines = [f"{title}: {need / GB:.1f} GB of {usable / GB:.1f} GB usable ({left})"]
    return lines + [f"  {v / GB:8.2f} GB  {k}  {mark(*plan.uses.get(k, ()))}" for k, v in items.items()]


def layout_lines(recipe: Recipe, plan: Plan) -> list[str]:
    if not plan.layouts:
        return []
    inf = recipe.inference
    first = plan.layouts[0].layout
    lines = [f"serving layouts for the {first.hosts * first.engines} inference hosts, each at what its KV holds "
             f"(weights {'FP8' if inf.fp8 else inf.dtype}, KV {inf.kv_cache_dtype}, MTP {inf.mtp_tokens} at acceptance "
             f"{recipe.plan.mtp_acceptance}; 'KV holds': sequences of the mean in-flight length per attention replica):",
             f"  {'layout':48} {'engines':>7} {'KV holds':>9} {'in flight':>9} {'tok/s/GPU':>9} {'rollout':>10}"]
    for r in plan.layouts:
        tag = "  <- recommended" if r is plan.best else ""
        tag += "  (the recipe's)" if r.layout == plan.rollout.layout else ""
        lines.append(f"  {r.layout.name:48} {r.layout.engines + r.layout.prefill_hosts:>7} {r.fits:>9.1f} "
                     f"{r.held * r.layout.replicas:>9.0f} {r.tokens_per_gpu:>9.0f} "
                     f"{minutes(r.seconds) if r.fits >= 1 else 'no room':>10}{tag}")
    return lines


def decode_lines(r: Rollout) -> list[str]:
    s = r.step
    busy = s.tokens / max(r.rate * s.seconds, 1e-30)
    lines = [f"decode step ({r.layout.name}, one replica, {busy:.1f} sequences decoding): {s.seconds * 1e3:.1f} ms, "
             f"{s.tokens:.1f} tokens kept, {r.rate:.1f} tokens/s a sequence, {r.tokens_per_gpu:,.0f} tokens/s a GPU"]
    lines += [f"  {v / GB:8.2f} GB read: {k}" for k, v in s.memory.items()]
    lines += [f"  {v * 1e3:8.2f} ms compute: {k}" for k, v in s.flops.items()]
    return lines + [f"  {s.comm * 1e3:8.2f} ms exchanges (not overlapped)"]


def flight_lines(plan: Plan) -> list[str]:
    f = plan.flight
    need = f["in flight needed (Little's law)"]
    return ["async, at the planned step (Little's law: in flight = trajectories a second x latency):",
            f"  trajectory latency mean {minutes(f['trajectory latency, mean (s)'])}, p99 "
            f"{minutes(f['trajectory latency, p99 (s)'])}; in flight needed {need:.0f}, "
            f"the KV holds {f['in flight the KV holds']:.0f}, the recipe allows "
            f"{f['in flight allowed (max_async_level, max_inflight_rollouts)']:.0f}",
            f"  needs rl.max_async_level >= {f['rl.max_async_level needed']:.0f} and rl.max_off_policy_steps >= "
            f"{f['rl.max_off_policy_steps needed']:.0f} (the p99 trajectory's age)"]


def split_line(label: str, s: Split | None) -> str:
    if s is None:
        return f"    {label}: none of this recipe's host counts"
    timed = f"; trainer step {minutes(s.trainer)}, rollout {minutes(s.rollout)} ({s.layout}), step " \
        f"{minutes(s.step)}" if s.trainer else ""
    return f"    {label}: {s.trainer_hosts} trainer hosts (ep = {s.ep}), {s.memory / GB:.1f} GB a trainer GPU{timed}"


def lora_lines(recipe: Recipe, plan: Plan) -> list[str]:
    """LoRA against full fine-tuning (`prl.sizing.compare`)."""
    cmp, lo = plan.lora, recipe.trainer.lora
    if cmp is None:
        return []
    m, u = cmp.memory, cmp.update
    plan_dtype = recipe.trainer.dtype
    lines = [f"with LoRA (rank {lo.rank}, alpha {lo.alpha:g}; {', '.join(lo.targets)}): {cmp.adapters / 1e9:.3f} B "
             f"adapter parameters on {cmp.adapted / 1e9:.1f} B base parameters; against full fine-tuning on the "
             f"same {plan.world} trainer GPUs:",
             f"  trainer GPU memory {m['lora'] / GB:.1f} GB against {m['full'] / GB:.1f} GB (frozen base, Adam over "
             f"the adapters alone); with the base at {plan_dtype} as built (no FP8 base yet), {m['as built'] / GB:.1f} GB",
             f"  weight update {u['lora'] / GB:.2f} GB a step against {u['full'] / GB:,.0f} GB (1/{u['full'] / max(u['lora'], 1.0):,.0f}; "
             f"adapters in fp32 on the wire), {minutes(cmp.update_s['lora'])} against {minutes(cmp.update_s['full'])}",
             f"  trainer GEMMs {minutes(cmp.gemms['lora'])} against {minutes(cmp.gemms['full'])} (no weight gradients "
             f"for the frozen base: computed, not measured); trainer step {minutes(cmp.trainer['lora'])} against "
             f"{minutes(cmp.trainer['full'])}"]
    if not cmp.fewest:
        return lines
    lines.append("  host split (the other hosts serving in their fastest layout at what its KV holds):")
    lines += [split_line(label, s) for label, s in (
        ("fewest that fit, LoRA", cmp.fewest["lora"]), ("fewest that fit, LoRA as built (no FP8 base)",
                                                        cmp.fewest["as built"]),
        ("fewest that fit, full fine-tuning", cmp.fewest["full"]), ("the recipe's", cmp.own),
        ("the shortest step", cmp.best))]
    return lines


def mechanism_lines(plan: Plan) -> list[str]:
    used = sorted({name for uses in plan.uses.values() for name in uses if MECHANISMS[name][0] != BUILT})
    return ["mechanisms the plan counts and prl does not have yet, or has untested on GPU:"] + \
        [f"  {name}: {MECHANISMS[name][0]} - {MECHANISMS[name][1]}" for name in used]


def served_model_lines(recipe: Recipe) -> list[str]:
    """The models the run serves beside the policy (a teacher, a reward model, an LLM judge): their servers and
    weights. They run on one machine today, so the step's time above does not count them."""
    from prl.model.pretrained import PretrainedError, check_pretrained

    judge = recipe.reward.judge
    served = [(k, m) for k, m in (("teacher", recipe.teacher), ("reward-model", recipe.reward.model),
                                  ("judge", judge if judge is not None and judge.path else None)) if m is not None]
    if not served:
        return []
    lines = ["models served beside the policy (on the orchestrator's machine; not in the step time above):"]
    for kind, m in served:
        try:
            b = check_pretrained(m.path).bytes
            size = f"{b / GB:.2f} GB" if b >= GB / 10 else f"{b / 2**20:.1f} MB"
            size = f"{size} of weights a server"
        except PretrainedError as e:
            size = f"its weights unknown here: {e}"
        lines.append(f"  {kind}: {m.servers} server(s) of {m.path} ({size})")
    return lines


def format_plan(recipe: Recipe, plan: Plan) -> str:
    n, par, t = plan.counts, recipe.trainer.parallel, recipe.trainer
    usable = recipe.plan.gpu_memory_gb * recipe.plan.memory_headroom * GB
    lines = [f"model: {plan.config_source}",
             f"  parameters {n.total / 1e9:.3f} B ({n.routed / 1e9:.3f} B in routed experts), active per token "
             f"{n.active / 1e9:.3f} B"]
    lines += workload_lines(recipe, plan)
    lines.append(f"trainer: {plan.world} ranks, dp_shard x cp = {plan.world // par.cp} x {par.cp} "
                 f"({getattr(par, 'cp_layout', 'contiguous')}), ep = {par.ep}, {t.dtype}{' + FP8 GEMMs' if t.fp8 else ''}, "
                 f"activation checkpointing {'on' if t.activation_checkpointing else 'off'}")
    lines += memory_lines("trainer GPU memory", plan.trainer, plan, usable)
    lines += layout_lines(recipe, plan)
    lines += memory_lines(f"inference GPU memory ({plan.rollout.layout.name})", plan.inference, plan, usable)
    lines += decode_lines(plan.rollout)
    lines.append("step time:")
    lines += [f"  {minutes(v):>11}  {k}  {mark(*plan.uses.get(k, ()))}{assumes(k)}" for k, v in plan.time.items()]
    lines += [f"  {x}" for x in plan.details]
    lines += lora_lines(recipe, plan) + flight_lines(plan) + served_model_lines(recipe) + mechanism_lines(plan)
    assumed = recipe.plan.model_dump()
    if assumed["overlap_efficiency"] is None:  # unset: the bench's figure for the recipe's overlap mode
        assumed["overlap_efficiency"] = tr.overlap_efficiency(recipe)
    lines.append("assumptions ([plan], settable with --set plan.KEY=VALUE): "
                 + ", ".join(f"{k} = {v}" for k, v in assumed.items()))
    lines += [f"NOTE: {x}" for x in plan.notes]
    lines += [f"DOES NOT FIT: {p}" for p in plan.problems] or ["fits: every GPU within its usable memory"]
    return "\n".join(lines)
