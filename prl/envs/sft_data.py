"""The warm start's demonstrations from a dataset file (`sft.data`), as supervised fine-tuning reads one.

A row is a prompt and a completion (`task.prompt_key`, `sft.completion_key`: strings, or chat messages) or
a whole conversation (`sft.messages_key`). The loss is on what the model writes: the completion, or every
assistant message of a conversation. With the chat template (`task.chat_template`) the conversation is
rendered by the tokenizer's template turn by turn, each assistant turn with the template's own end of turn;
without it (prl's tiny tokenizer) the prompt's text is followed by the completion's text and EOS."""

from __future__ import annotations

from prl.envs import make_env
from prl.envs.base import Trajectory
from prl.tasks.data import BadRow
from prl.tasks.files import CHECKED_ROWS, open_source
from prl.tasks.prompts import PromptError, check_messages, messages, raw_text, render, uses_template

ASSISTANT = "assistant"


class SftFile:
    """Demonstrations by index from `sft.data`, shuffled per epoch by `seed` (`shuffle`: false reads file order)."""

    def __init__(self, sft, task, tokenizer, seed: int, shuffle: bool = True):
        self.source = open_source(sft.data, None, shuffle=shuffle)
        self.sft, self.task, self.tokenizer, self.seed = sft, task, tokenizer, seed
        self.templated = uses_template(tokenizer, task.chat_template)

    def row(self, index: int) -> tuple[dict, int]:
        at = self.source.row_of(index, self.seed)
        return self.source.rows.row(at), at

    def conversation(self, row: dict, at: int) -> tuple[list[dict], int]:
        """The row as chat messages, and where what the model learns to write starts: after its prompt's messages
        (prompt/completion rows), or at its conversation's first assistant message."""
        p, c, m = self.task.prompt_key, self.sft.completion_key, self.sft.messages_key
        system = self.task.system_prompt if self.templated else None  # as the task renders prompts
        try:
            if p in row and c in row:
                completion = row[c]
                tail = [{"role": ASSISTANT, "content": completion}] if isinstance(completion, str) else completion
                head = messages(row[p], system)
                return head + check_messages(tail), len(head)
            if m in row:
                msgs = messages(row[m], system)
                return msgs, first_assistant(msgs, self.sft.data, at)
        except PromptError as e:
            raise BadRow(f"{self.sft.data}: row {at}: {e}") from None
        raise BadRow(f"{self.sft.data}: row {at} has neither {p!r} and {c!r} nor {m!r} (it has "
                     f"{', '.join(map(str, row))}); set task.prompt_key, sft.completion_key or sft.messages_key")

    def example(self, index: int) -> dict:
        """The demonstration's prompt, as training's streams compare prompts (`prl.evaluation.sets`)."""
        row, at = self.row(index)
        msgs, first = self.conversation(row, at)
        return {"prompt": row.get(self.task.prompt_key, msgs[:first])}

    def demonstration(self, index: int) -> Trajectory:
        row, at = self.row(index)
        msgs, first = self.conversation(row, at)
        if not any(msg.get("role") == ASSISTANT for msg in msgs[first:]):
            raise BadRow(f"{self.sft.data}: row {at} has no assistant message to learn to write")
        render_ids = templated_ids if self.templated else raw_ids
        prompt, completion, mask = render_ids(self.tokenizer, msgs, first, self.sft.data, at)
        return Trajectory(prompt, completion, [0.0] * len(completion), [0] * len(completion), 1.0, mask=mask)


def warm_start_source(env, task, sft, seed: int, tokenizer, sampling):
    """Where the warm start's demonstrations come from (`.demonstration(index)`, `.example(index)`): `sft.data`'s
    rows, or the environment's own (`Environment.demonstration`). `seed`: the warm start's (apart from RL's)."""
    if sft is not None and sft.data is not None:
        return SftFile(sft, task, tokenizer, seed)
    return make_env(env, task, seed, tokenizer, sampling, 1, False)


def first_assistant(msgs: list[dict], path: str, at: int) -> int:
    for j, m in enumerate(msgs):
        if m.get("role") == ASSISTANT:
            if j == 0:
                break
            return j
    raise BadRow(f"{path}: row {at} has no assistant message after a prompt: nothing to learn to write")


def templated_ids(tokenizer, msgs: list[dict], first: int, path: str, at: int) -> tuple[list[int], list[int], list[int]]:
    """Prompt ids (the messages before `first`, the assistant's turn opened), then every later token, mask 1 on
    assistant turns."""
    ids = render(tokenizer, msgs[:first], generation_prompt=True)
    prompt, mask = list(ids), []
    for j in range(first, len(msgs)):
        is_model = msgs[j].get("role") == ASSISTANT
        nxt = j + 1 < len(msgs) and msgs[j + 1].get("role") == ASSISTANT
        upto = render(tokenizer, msgs[:j + 1], generation_prompt=nxt and not is_model)
        if upto[:len(ids)] != ids:
            raise BadRow(f"{path}: row {at}: the chat template renders the conversation's earlier turns differently "
                         f"once turn {j} follows (so no tokens are trained twice); give prompt/completion rows")
        mask += [int(is_model)] * (len(upto) - len(ids))
        ids = upto
    return prompt, ids[len(prompt):], mask


def raw_ids(tokenizer, msgs: list[dict], first: int, path: str, at: int) -> tuple[list[int], list[int], list[int]]:
    """No template: the text of the messages before `first`, then the assistant messages' text after it and EOS."""
    prompt = tokenizer(raw_text(msgs[:first])).input_ids
    text = raw_text([m for m in msgs[first:] if m.get("role") == ASSISTANT])
    completion = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt, completion, [1] * len(completion)


def check_sft_file(sft, task, tokenizer) -> None:
    """The file opens and its first rows render as the warm start renders them; a ValueError naming the row."""
    demos = SftFile(sft, task, tokenizer, seed=0, shuffle=False)
    for index in range(min(CHECKED_ROWS, len(demos.source))):
        demos.demonstration(index)
