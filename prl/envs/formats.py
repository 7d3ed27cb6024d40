"""How turns look in tokens: the first prompt, tool calls parsed from the model's text, and the
environment's reply as token ids appended after the model's own (never re-tokenising the history).

- `ChatFormat`: a Hugging Face model's chat template with the Qwen3 / GLM tool-call convention, the
  model writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The environment's reply
  is the template's rendering of the new message(s) *after* an assistant turn, taken as a delta from
  a fixed stand-in conversation (so the history is never rendered again), starting right after the
  end-of-turn token the model sampled.
- `TinyFormat`: prl's character-level tiny models have no chat template and a small alphabet
  (`prl.model.tiny.CHARS`): a call is `call:NAME ARG ARG...` (positional arguments in the tool's
  parameter order, separated by spaces), a reply is ` res:TEXT=` for a tool and ` TEXT=` for program
  feedback, appended as the tokenizer's ids of that text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from prl.envs.tools import Tool


@dataclass
class ParsedCall:
    name: str
    args: object  # what the model wrote; checked against the tool's schema by the ToolBox
    error: str | None = None  # the call could not be read at all (bad JSON, ...)


class TinyFormat:
    CALL = re.compile(r"call:(\w+)((?: +[^ ]+)*)")
    templated = False  # no chat template: nothing renders the history another way

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, text: str, tools: list[Tool]) -> list[int]:
        return self.tokenizer(text).input_ids

    def parse_calls(self, text: str, tools: dict[str, Tool]) -> list[ParsedCall]:
        out = []
        for m in self.CALL.finditer(text):
            name, raw = m.group(1), m.group(2).split()
            tool = tools.get(name)
            if tool is None:
                out.append(ParsedCall(name, {}))
                continue
            names = list(tool.params)
            if len(raw) > len(names):
                out.append(ParsedCall(name, raw, f"{name} takes {len(names)} argument(s), got {len(raw)}"))
                continue
            out.append(ParsedCall(name, {k: coerce(v, tool.params[k]["type"]) for k, v in zip(names, raw)}))
        return out

    def call_text(self, name: str, args: dict) -> str:
        return f"call:{name} " + " ".join(str(v) for v in args.values())

    def reply_ids(self, kind: str, text: str) -> list[int]:
        """`kind`: "tool" (a tool's result) or "feedback" (a program's outcome)."""
        body = " res:" + text if kind == "tool" else " " + text
        return self.tokenizer(body.lower() + "=").input_ids


def coerce(value: str, json_type: str):
    """A positional argument written as text, as the type the tool declares (left as text if it
    does not parse: the schema check then answers the model)."""
    try:
        return {"integer": int, "number": float}.get(json_type, str)(value)
    except ValueError:
        return value


class ChatFormat:
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    templated = True
    STANDIN = "prl-standin-reply"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id])

    def prompt_ids(self, text: str, tools: list[Tool]) -> list[int]:
        schemas = [{"type": "function", "function": t.schema} for t in tools] or None
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=schemas,
                                                      add_generation_prompt=True, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False).input_ids

    def parse_calls(self, text: str, tools: dict[str, Tool]) -> list[ParsedCall]:
        out = []
        for m in self.CALL.finditer(text):
            try:
                call = json.loads(m.group(1).strip())
                args = call.get("arguments", {})
                args = json.loads(args) if isinstance(args, str) else args
                out.append(ParsedCall(str(call["name"]), args))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                out.append(ParsedCall("?", None, f"unreadable tool call ({type(e).__name__}: {e}): "
                                                  f"{m.group(1).strip()[:120]}"))
        return out

    def render_ids(self, prompt: str, tools: list[Tool], turns: list[str], replies: list[str], kind: str) -> list[int]:
        """The conversation as the chat template renders it whole, tokenised again: what a framework that
        re-tokenises the history each turn would train on (`retokenize_forks`)."""
        messages = [{"role": "user", "content": prompt}]
        for k, text in enumerate(turns):
            messages.append({"role": "assistant", "content": text})
            if k < len(replies):
                messages.append({"role": "tool" if kind == "tool" else "user", "content": replies[k]})
        schemas = [{"type": "function", "function": t.schema} for t in tools] or None
        rendered = self.tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)
        return self.tokenizer(rendered, add_special_tokens=False).input_ids

    def call_text(self, name: str, args: dict) -> str:
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"

    def reply_ids(self, kind: str, text: str) -> list[int]:
        """The template's tokens for a tool result (role "tool") or program feedback (role "user")
        after an assistant turn, up to the next assistant turn's start."""
        role = "tool" if kind == "tool" else "user"
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self.STANDIN}]
        head = self.tokenizer.apply_chat_template(base, tokenize=False)
        full = self.tokenizer.apply_chat_template([*base, {"role": role, "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        end = head.index(self.STANDIN) + len(self.STANDIN)
        if head[end:].startswith(self.eos_text):  # the model sampled its end-of-turn token itself
            end += len(self.eos_text)
        return self.tokenizer(full[end:], add_special_tokens=False).input_ids


def make_format(kind: str, tokenizer):
    """`kind`: "tiny", "chat", or "auto" (chat when the tokenizer has a chat template)."""
    if kind == "auto":
        kind = "chat" if getattr(tokenizer, "chat_template", None) else "tiny"
    return ChatFormat(tokenizer) if kind == "chat" else TinyFormat(tokenizer)
