"""On-policy distillation: the teacher's servers score every token the student sampled. With `mode = "advantage"`
each model token's advantage becomes `kl_coef * (log p_teacher - log p_student) + reward_weight * A`, A the task
reward's group advantage; with `mode = "loss"` the samples carry the teacher's logprobs, their advantage is
`reward_weight * A`, and the trainer adds `kl_coef` times the KL to the teacher to its loss.

Rules:
- one `/score` request per group (each trajectory's prompt and completion, scored from the completion's first
  token): one forward of the group, nothing generated; the teacher's weights never change, so every answer is
  under the same model;
- the student's logprob of a token is the one the inference server sampled it with (the policy that sampled it,
  as the importance ratio uses); environment tokens (mask 0) get no advantage;
- a teacher server that fails or hangs is retried as `prl.orchestrator.frozen` says; past its retries the
  orchestrator fails like on any server fault (and is restarted);
- the step's mean of `log p_student - log p_teacher` over model tokens (`teacher_kl`, the reverse KL's k1
  estimate) is logged with each step.
"""

from __future__ import annotations

from prl.backends.base import MalformedResponse
from prl.orchestrator.frozen import FrozenServers


def distill_advantages(teacher: list[float], student: list[float], mask: list[int] | None, group_advantage: float,
                       kl_coef: float, reward_weight: float) -> list[float]:
    """Per completion token: kl_coef * (teacher - student) + reward_weight * group_advantage on the model's tokens,
    0 on the environment's."""
    mask = mask if mask is not None else [1] * len(student)
    return [kl_coef * (t - s) + reward_weight * group_advantage if m else 0.0
            for t, s, m in zip(teacher, student, mask)]


class Teacher:
    def __init__(self, cfg, servers: FrozenServers):
        self.cfg, self.servers = cfg, servers

    async def logprobs(self, trajs) -> list[list[float]]:
        """The teacher's logprob of each completion token of each trajectory (those with a completion), in one request
        retried across its servers while they come back."""
        items = [([*t.prompt_ids, *t.completion_ids], len(t.prompt_ids)) for t in trajs if t.completion_ids]
        if not items:
            return []
        scored = (await self.servers.call(lambda b: b.score(items))).logprobs
        if [len(x) for x in scored] != [len(ids) - start for ids, start in items]:
            raise MalformedResponse(f"the teacher answered {[len(x) for x in scored]} logprobs for completions of "
                                    f"{[len(ids) - start for ids, start in items]} tokens")
        return scored

    async def scored(self, trajs) -> tuple[list[list[float]], tuple[float, int]]:
        """Each trajectory's teacher logprobs (empty without a completion), and (sum, count) of log p_student -
        log p_teacher over model tokens."""
        it = iter(await self.logprobs(trajs))
        out, total, count = [], 0.0, 0
        for t in trajs:
            teacher = next(it) if t.completion_ids else []
            mask = t.mask if t.mask is not None else [1] * len(teacher)
            total += sum(s - q for s, q, m in zip(t.logprobs, teacher, mask) if m)
            count += sum(mask)
            out.append(teacher)
        return out, (total, count)

    async def token_advantages(self, trajs, advantages: list[float]) -> tuple[list[list[float]], tuple[float, int]]:
        """Each trajectory's per-token advantages, and (sum, count) of log p_student - log p_teacher over model tokens."""
        taught, kl = await self.scored(trajs)
        return [distill_advantages(q, t.logprobs, t.mask, a, self.cfg.kl_coef, self.cfg.reward_weight)
                for t, q, a in zip(trajs, taught, advantages)], kl
