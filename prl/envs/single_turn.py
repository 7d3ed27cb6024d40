"""The single-turn environment: today's tasks (`prl.tasks`: a dataset and a reward on the text).

One request per group (`n` = the group size, so the server computes the prompt once), each
completion decoded and scored by the task's reward. (One request per member, which would free each
member's place in the in-flight budget as it finishes, made the embedded server's generation 4x
slower on reverse-tiny, `bench/vs_trl.py`: 8x the HTTP requests and engine admissions. A response
streaming each member as it finishes is the way to that, not built.)"""

from __future__ import annotations

from prl.envs.base import EnvContext, Environment, Sampler, SkipExample, Trajectory
from prl.inference.protocol import GenerateRequest, decode_routing


class SingleTurnEnv(Environment):
    multi_turn = False

    def __init__(self, task, tokenizer, sampling, group_size: int, router_replay: bool):
        self.task, self.tokenizer, self.sampling = task, tokenizer, sampling
        self.group_size, self.router_replay = group_size, router_replay

    @classmethod
    def from_context(cls, ctx: EnvContext) -> "SingleTurnEnv":
        return cls(ctx.task, ctx.tokenizer, ctx.sampling, ctx.group_size, ctx.router_replay)

    def example(self, index: int) -> dict:
        return self.task.example(index)

    def prompt_ids(self, example: dict) -> list[int]:
        """The example's prompt as the task renders it (`prl.tasks.prompts`); SkipExample past a dataset
        file's `max_prompt_tokens`."""
        ids = self.task.prompt_ids(self.tokenizer, example["prompt"])
        cap = self.task.max_prompt_tokens
        if cap is not None and len(ids) > cap:
            raise SkipExample(f"prompt of {len(ids)} tokens, longer than task.max_prompt_tokens = {cap}")
        return ids

    def demonstration(self, index: int) -> Trajectory:
        """The prompt, then the answer and EOS."""
        example = self.task.example(index)
        answer = self.tokenizer(example["answer"], add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        return Trajectory(self.prompt_ids(example), answer, [0.0] * len(answer), [0] * len(answer), 1.0)

    async def rollout(self, example: dict, sampler: Sampler) -> list[Trajectory]:
        prompt_ids = self.prompt_ids(example)
        req = GenerateRequest(
            prompt_ids=prompt_ids, max_tokens=self.sampling.max_tokens, temperature=self.sampling.temperature,
            top_p=self.sampling.top_p, n=self.group_size, return_routing=self.router_replay, final=True,
        )
        resp = await sampler.generate(req)
        out = []
        for c in resp.completions:
            text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            reward, answer = self.task.score(text, example)
            out.append(Trajectory(prompt_ids, c.token_ids, c.logprobs, c.versions, reward,
                                  routing=sample_routing(resp, c), answer=text.strip() if answer is None else answer))
        return out


def sample_routing(resp, completion):
    """Prompt routing (sent once per group) followed by this completion's: one row per input token."""
    if resp.prompt_routing is None:
        return None
    import torch

    return torch.cat([decode_routing(resp.prompt_routing), decode_routing(completion.routing)])
