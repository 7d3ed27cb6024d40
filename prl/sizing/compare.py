"""LoRA against full fine-tuning, for `prl plan` on a recipe with trainer.lora: a trainer GPU's memory,
the weight update and the trainer's GEMMs both ways, the fewest trainer hosts that fit, and how the
recipe's hosts are best split between the trainer and the inference engines.

A trainer host count is tried with the recipe's trainer layout kept valid (`at_hosts`): its cp and
trainer.nproc, dp_shard = world / cp, and the widest ep that divides both the world and the routed
experts (the least expert memory a GPU; at the recipe's own host count, the recipe's ep). The other hosts serve in their fastest layout
(`prl.sizing.layouts.candidates`), each at what its KV holds, as the layout table compares them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prl.model.families import routed_experts
from prl.recipe.schema import Recipe
from prl.sizing import lora
from prl.sizing import trainer as tr
from prl.sizing.layouts import Layout, candidates
from prl.sizing.params import Counts
from prl.sizing.rollout import Rollout, evaluate, weight_send_seconds, weights_moved
from prl.sizing.workload import Workload


@dataclass(frozen=True)
class Split:
    trainer_hosts: int
    ep: int
    memory: float  # bytes a trainer GPU needs
    trainer: float = 0.0  # seconds of the trainer's step (0: not timed)
    rollout: float = 0.0  # seconds of the rollout a step, the other hosts in their fastest layout
    layout: str = ""  # that layout

    @property
    def step(self) -> float:
        return max(self.trainer, self.rollout)


@dataclass
class LoraComparison:
    adapters: int  # adapter parameters
    adapted: int  # base parameters under an adapter
    memory: dict[str, float]  # a trainer GPU's bytes on the recipe's hosts: "lora", "as built", "full"
    update: dict[str, float]  # bytes a weight update delivers to the inference hosts: "lora", "full"
    update_s: dict[str, float]  # seconds of the rollout's weight update: "lora", "full"
    gemms: dict[str, float]  # seconds of the trainer's GEMMs: "lora", "full"
    trainer: dict[str, float]  # seconds of the trainer's step: "lora", "full"
    fewest: dict[str, Split | None]  # the fewest trainer hosts that fit: "lora", "as built", "full"
    own: Split | None = None  # the recipe's split, timed as the others
    best: Split | None = None  # the split with the shortest step


def at_hosts(recipe: Recipe, c: dict, hosts: int) -> Recipe | None:
    """The recipe with its trainer layout on `hosts` trainer hosts (module docstring); None where no valid
    layout keeps the recipe's cp. Only trainer.parallel changes: the sizing functions take the world."""
    t, par = recipe.trainer, recipe.trainer.parallel
    world, experts = hosts * t.nproc, routed_experts(c) or 1
    ep = par.ep if hosts == recipe.trainer_hosts() else math.gcd(world, experts)
    if ep == 1 and (par.ep_dispatch == "fp8" or par.ep_node_dedup):
        return None
    new = par.model_copy(update={"ep": ep, "dp_shard": -1})
    try:
        new.check(world, experts, t.nproc)
    except ValueError:
        return None
    return recipe.model_copy(update={"trainer": t.model_copy(update={"parallel": new})})


def trainer_seconds(recipe: Recipe, c: dict, n: Counts, w: Workload, world: int, layout: Layout) -> float:
    """The trainer's step as `prl plan` counts it: compute, communication and the weight send, overlapped
    as trainer.parallel.overlap and plan.overlap_efficiency say."""
    compute = tr.compute_seconds(recipe, c, n, w, world)
    send = weight_send_seconds(recipe, c, n, layout, world)
    return tr.step_seconds(recipe, compute, tr.comm_seconds(recipe, c, n, w, world), send)


def fastest_rollout(recipe: Recipe, c: dict, n: Counts, w: Workload, hosts: int, world: int) -> Rollout | None:
    """The fastest layout of `hosts` inference hosts whose KV holds a sequence, at what its KV holds."""
    held = [r for lay in candidates(recipe, hosts) if (r := evaluate(recipe, c, n, lay, w, world, capped=False)).fits >= 1]
    return min(held, key=lambda r: r.seconds, default=None)


def split(recipe: Recipe, c: dict, n: Counts, w: Workload | None, hosts: int, total: int,
          as_built: bool = False) -> Split | None:
    """`hosts` trainer hosts of `total`: a trainer GPU's memory, and (with a workload `w`) the trainer's
    and the rollout's step; None where the recipe's layout has no valid form there, or nothing serves."""
    r = at_hosts(recipe, c, hosts)
    if r is None:
        return None
    world = hosts * recipe.trainer.nproc
    memory = sum(tr.trainer_memory(r, c, n, world, as_built).values())
    if w is None:
        return Split(hosts, r.trainer.parallel.ep, memory)
    roll = fastest_rollout(r, c, n, w, total - hosts, world) if total > hosts else None
    if roll is None:
        return None
    return Split(hosts, r.trainer.parallel.ep, memory, trainer_seconds(r, c, n, w, world, roll.layout),
                 roll.seconds, roll.layout.name)


def fewest(recipe: Recipe, c: dict, n: Counts, w: Workload, total: int, usable: float,
           as_built: bool = False) -> Split | None:
    """The fewest trainer hosts (of `total`, one left to serve) whose GPUs hold the trainer, timed where the
    other hosts serve."""
    found = (split(recipe, c, n, None, h, total, as_built) for h in range(1, total))
    least = next((s for s in found if s is not None and s.memory <= usable), None)
    return least and (split(recipe, c, n, w, least.trainer_hosts, total, as_built) or least)


def splits(recipe: Recipe, c: dict, n: Counts, w: Workload, total: int, usable: float) -> list[Split]:
    """Every trainer host count of `total` whose trainer fits and whose other hosts serve, timed."""
    found = (split(recipe, c, n, w, h, total) for h in range(1, total))
    return [s for s in found if s is not None and s.memory <= usable]


def compare(recipe: Recipe, c: dict, n: Counts, w: Workload, world: int, layout: Layout) -> LoraComparison:
    """LoRA (the recipe) against full fine-tuning (the recipe without trainer.lora) on the recipe's hosts,
    and the host counts each needs."""
    full, pl = lora.without_lora(recipe), recipe.plan
    usable = pl.gpu_memory_gb * pl.memory_headroom * 1e9
    dense, routed = lora.adapters(c, n, recipe.trainer.lora)
    both = {"lora": recipe, "full": full}
    out = LoraComparison(
        adapters=dense + routed, adapted=sum(lora.adapted(c, n, recipe.trainer.lora)),
        memory={k: sum(tr.trainer_memory(recipe if k != "full" else full, c, n, world, k == "as built").values())
                for k in ("lora", "as built", "full")},
        update={k: weights_moved(r, c, n, layout) for k, r in both.items()},
        update_s={k: evaluate(r, c, n, layout, w, world).times["weight update"] for k, r in both.items()},
        gemms={k: sum(v for t, v in tr.compute_seconds(r, c, n, w, world).items() if t.startswith("GEMMs"))
               for k, r in both.items()},
        trainer={k: trainer_seconds(r, c, n, w, world, layout) for k, r in both.items()},
        fewest={})
    if recipe.cluster is None:
        return out
    total = recipe.trainer_hosts() + len(recipe.placement_or_default().inference)
    out.fewest = {"lora": fewest(recipe, c, n, w, total, usable), "full": fewest(full, c, n, w, total, usable),
                  "as built": fewest(recipe, c, n, w, total, usable, as_built=True)}
    timed = splits(recipe, c, n, w, total, usable)
    out.own = next((s for s in timed if s.trainer_hosts == recipe.trainer_hosts()), None)
    out.best = min(timed, key=lambda s: (round(s.step, 6), s.trainer_hosts), default=None)
    return out
