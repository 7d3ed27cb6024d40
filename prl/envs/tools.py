"""Tools a model can call: plain Python functions named `module:function`, each with a JSON schema of
its arguments derived from its signature, and calls that can never take a rollout down.

Rules:
- a call the model got wrong (unknown tool, bad arguments, wrong types) is answered to the model as
  an error and counted; it never raises into the rollout;
- a tool that raises answers its exception's type and message; one that runs past `timeout_s`
  answers a timeout (its thread is abandoned: tools are the recipe author's trusted code, not the
  model's; model-written code runs in `prl.sandbox`); a result longer than `max_chars` is cut with a
  marker.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from dataclasses import dataclass
from typing import Any, Callable

from prl.tasks import import_function

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"name", "description", "parameters": JSON schema}

    @property
    def params(self) -> dict:
        return self.schema["parameters"]["properties"]


@dataclass
class CallResult:
    text: str
    error: str | None = None  # "unknown_tool", "bad_arguments", "raised", "timeout"


def load_tool(spec: str) -> Tool:
    """`module:function` imported (a ValueError naming `env.tools` when it cannot be)."""
    name = spec.partition(":")[2]
    fn = import_function(spec, "env.tools")
    return Tool(name, fn, tool_schema(name, fn))


def tool_schema(name: str, fn: Callable) -> dict:
    """The function's JSON schema (as chat templates take tools): parameter types from annotations
    (str when absent), required = the parameters without defaults."""
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation if p.annotation is not inspect.Parameter.empty else str
        if isinstance(ann, str):  # postponed annotations: a name
            ann = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(ann, str)
        props[p.name] = {"type": JSON_TYPES.get(ann, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    return {"name": name, "description": doc.split("\n\n")[0],
            "parameters": {"type": "object", "properties": props, "required": required}}


def check_arguments(tool: Tool, args: Any) -> str | None:
    """Why `args` does not fit the tool's schema, or None."""
    if not isinstance(args, dict):
        return f"arguments must be an object, got {type(args).__name__}"
    unknown = sorted(set(args) - set(tool.params))
    if unknown:
        return f"unknown argument(s) {unknown}; {tool.name} takes {sorted(tool.params)}"
    missing = [r for r in tool.schema["parameters"]["required"] if r not in args]
    if missing:
        return f"missing argument(s) {missing}"
    for k, v in args.items():
        want = tool.params[k]["type"]
        ok = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
              "object": dict}[want]
        if not isinstance(v, ok) or (want in ("integer", "number") and isinstance(v, bool)):
            return f"argument {k!r} must be {want}, got {type(v).__name__}"
    return None


class ToolBox:
    """The recipe's tools by name, and calls with a timeout and an output cap."""

    def __init__(self, tools: list[Tool], timeout_s: float, max_chars: int):
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.max_chars = timeout_s, max_chars

    def schemas(self) -> list[dict]:
        return [{"type": "function", "function": t.schema} for t in self.tools.values()]

    async def call(self, name: str, args: Any) -> CallResult:
        tool = self.tools.get(name)
        if tool is None:
            return CallResult(f"error: unknown tool {name!r}; tools: {', '.join(self.tools)}", "unknown_tool")
        why = check_arguments(tool, args)
        if why:
            return CallResult(f"error: {name}: {why}", "bad_arguments")
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await in_thread(lambda: tool.fn(**args))
        except TimeoutError:
            return CallResult(f"error: {name} took longer than {self.timeout_s:g} s", "timeout")
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's information, not ours
            return CallResult(f"error: {name} raised {type(e).__name__}: {e}", "raised")
        return CallResult(cap(out if isinstance(out, str) else json.dumps(out, default=str), self.max_chars))


def in_thread(fn) -> asyncio.Future:
    """`fn()` on a daemon thread of its own: the event loop never waits on it, and a tool that never
    returns is left behind without holding up the process's exit (a pool's threads are joined)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def work() -> None:
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - handed to the awaiting call
            result, error = None, e
        loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="prl-tool", daemon=True).start()
    return fut


def cap(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f" [cut at {max_chars} of {len(text)} chars]"
