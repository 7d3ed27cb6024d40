"""Turns with tools: the model answers or calls tools; prl runs the calls and appends their results
as environment tokens; the model's last turn without a call is its answer, scored by the task."""

from __future__ import annotations

from prl.envs.base import EnvContext
from prl.envs.multi_turn import Episode, MultiTurnEnv
from prl.envs.tools import ToolBox


class ToolEnv(MultiTurnEnv):
    def __init__(self, toolbox: ToolBox, **kw):
        super().__init__(**kw)
        self.toolbox = toolbox

    @classmethod
    def from_context(cls, ctx: EnvContext) -> "ToolEnv":
        from prl.envs.tools import load_tool

        env = ctx.cfg
        return cls(ToolBox([load_tool(t) for t in env.tools], env.tool_timeout_s, env.max_env_chars),
                   **cls.context_args(ctx))

    reply_kind = "tool"

    def prompt_tools(self) -> list:
        return list(self.toolbox.tools.values())

    def prompt_ids(self, example: dict) -> list[int]:
        return self.fmt.prompt_ids(example["prompt"], self.prompt_tools())

    async def respond(self, ep: Episode, text: str, example: dict) -> list[int] | None:
        calls = self.fmt.parse_calls(text, self.toolbox.tools)
        if not calls:
            return None  # an answer: the episode is over
        results = []
        for call in calls:
            ep.stats["tool_calls"] += 1
            if call.error:
                ep.stats["tool_errors"] += 1
                ep.stats["tool_error.malformed"] += 1
                results.append(f"error: {call.error}")
                continue
            out = await self.toolbox.call(call.name, call.args)
            if out.error:
                ep.stats["tool_errors"] += 1
                ep.stats[f"tool_error.{out.error}"] += 1
            results.append(out.text)
        ep.replies.append("\n".join(results))
        return self.fmt.reply_ids("tool", ep.replies[-1])

    def demonstration(self, index: int):
        """The example's own calls (`example["calls"]`: [name, arguments] pairs, if the task gives
        them), each followed by the tool's real result, then the answer."""
        example = self.task.example(index)
        ep = Episode(self.prompt_ids(example))
        for name, args in example.get("calls", []):
            self.model_turn(ep, self.fmt.call_text(name, args))
            self.env_turn(ep, self.fmt.reply_ids("tool", str(self.toolbox.tools[name].fn(**args))))
        self.model_turn(ep, example["answer"])
        return self.demo(ep)

    def turn_rewards(self, ep: Episode, example: dict) -> list[float]:
        """`rl.credit = "turn"`: every turn is credited with the episode's score, but against the members
        that reached that turn with the same tool results (`turn_states`): an answer is judged by what it
        made of the results it got, not by whether an earlier call fetched the right ones."""
        return [self.score(ep, example)] * ep.turns

    def turn_states(self, ep: Episode) -> list:
        return [tuple(ep.replies[:k]) for k in range(ep.turns)]

    def score(self, ep: Episode, example: dict) -> float:
        if self.fmt.parse_calls(ep.last_text, self.toolbox.tools):
            return 0.0  # cut by a limit while still calling tools: no answer
        return self.task.reward(ep.last_text, example)
