"""Load a TOML recipe, apply `--set key=value` overrides, validate; errors name the key and the file.

This is the schema's validation; what needs the classes a recipe names is checked on top of it where the
run is launched (`prl.launch.checks.load`)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from prl.recipe.schema import CALLABLE, EnvCfg, Recipe, TaskCfg, takes_options



class RecipeError(ValueError):
    """A recipe problem a person can fix: the message names the file and the dotted key."""


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file (a recipe is TOML, UTF-8)") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot be read ({e.strerror})") from None
    for item in overrides or []:
        apply_override(data, item)
    absolute_data_paths(data)
    inherit_eval_tables(data)
    return validate(data, str(path), set_keys=set_keys(overrides))


def absolute_data_paths(data: dict) -> None:
    """Dataset files given relative to the folder prl runs in, made absolute where they exist, so a resumed run or
    `prl eval` started elsewhere reads the same file (one that does not exist is left as given, and refused)."""
    tables = [data.get("task"), data.get("sft")]
    for ev in eval_tables(data):
        if isinstance(ev, dict):
            tables += [ev, ev.get("task")]
    for table in tables:
        if isinstance(table, dict) and isinstance(table.get("data"), str):
            given = Path(table["data"]).expanduser()
            if not given.is_absolute() and given.exists():
                table["data"] = str(given.resolve())


TASK_PRESENTATION = ("chat_template", "system_prompt", "max_prompt_tokens")  # how any task's prompts render
TASK_EXAMPLES = ("dataset", "data", "rows", "shuffle", "prompt_key", "answer_key", "min_len", "max_len")  # which


def inherit_eval_tables(data: dict) -> None:
    """An eval set's `task` and `env` tables start from the recipe's and override only the keys they set. A set's
    task that names another task keeps only the recipe's prompt rendering; one that reads other examples (its own
    `dataset` or `data`) keeps the recipe's task name and reward as well; an env of another kind starts from the
    defaults. Only keys the schema knows are inherited (a typo in [task] is reported once)."""
    for ev in eval_tables(data):
        if not isinstance(ev, dict):
            continue
        task, env = ev.get("task"), ev.get("env")
        if isinstance(task, dict) and isinstance(data.get("task"), dict):
            ev["task"] = {**task_base(data["task"], task), **task}
            drop_unusable_options(ev["task"], "options" in task)
        if isinstance(env, dict) and isinstance(data.get("env"), dict):
            base = {k: v for k, v in data["env"].items() if k in EnvCfg.model_fields}
            if env.get("kind", base.get("kind", "single_turn")) == base.get("kind", "single_turn"):
                ev["env"] = {**base, **env}


def eval_tables(data: dict) -> list:
    """The eval sets' tables as written (none where `eval` is not a table: the schema refuses it)."""
    sets = data.get("eval")
    return list(sets.values()) if isinstance(sets, dict) else []


def task_base(recipe_task: dict, task: dict) -> dict:
    """What an eval set's task table inherits of the recipe's."""
    base = {k: v for k, v in recipe_task.items() if k in TaskCfg.model_fields}
    if "name" in task and task["name"] != base.get("name", DEFAULT_TASK["name"]):
        return {k: v for k, v in base.items() if k in TASK_PRESENTATION}
    if any(k in task and task[k] != base.get(k, DEFAULT_TASK[k]) for k in ("dataset", "data")):
        return {k: v for k, v in base.items() if k not in TASK_EXAMPLES}
    return base


def drop_unusable_options(task: dict, own: bool) -> None:
    """Inherited task.options where the set's task has no function to take them (its reward a checker)."""
    if not own and not takes_options(task.get("name", ""), task.get("dataset"), task.get("reward")):
        task.pop("options", None)


DEFAULT_TASK = {k: TaskCfg.model_fields[k].default for k in ("name", "dataset", "data")}


def set_keys(overrides: list[str] | None) -> list[str]:
    """The dotted keys `--set KEY=VALUE` overrides give."""
    return [item.partition("=")[0].strip() for item in overrides or []]


def validate(data: dict[str, Any], source: str, set_keys: list[str] = ()) -> Recipe:
    """`set_keys`: the dotted keys `--set` gave; an error in one of them is named as theirs."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_errors(e, source, set_keys)) from None


def format_errors(err: ValidationError, source: str, set_keys: list[str] = ()) -> str:
    lines, said = [], {}
    for item in err.errors():
        loc = [str(p) for p in item["loc"]]
        while loc and UNION_TAG.fullmatch(loc[-1]):  # a value of a union: one line for its key
            loc.pop()
        key = ".".join(loc)
        msg = item["msg"].removeprefix("Value error, ")
        if not key or msg.startswith((f"{key}.", f"{key} ")):  # a check across keys: its message names them
            lines.append(refusal(msg, source, set_keys))
            continue
        msg = re.sub(r" or instance of \w+Cfg", "", msg)  # a table: the schema's class names are not the user's
        if item["type"] == "string_pattern_mismatch" and CALLABLE in str(item.get("ctx", {}).get("pattern")):
            msg = f"{item.get('input')!r:.60} is not 'module:function' (a module on the path, then its function)"
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `prl run --dry-run` prints every valid key)"
        elif item["type"] in STRICT_TYPES:
            given = item.get("input")
            msg += f" (got {'the string' if isinstance(given, str) else type(given).__name__} {given!r:.40}" + \
                (f": {STRICT_TYPES[item['type']]})" if STRICT_TYPES[item["type"]] else ")")
        if key in said:  # another member of the union: one line says every choice
            lines[said[key]] += f"; or {msg}"
            continue
        given = next((k for k in set_keys if key == k or key.startswith(k + ".")), None)
        said[key] = len(lines)
        lines.append(f"--set {given}: {msg}" if given else f"{source}: {key}: {msg}")
    return "\n".join(lines)


# types never converted (strict), with what to write instead
STRICT_TYPES = {"bool_type": "write true or false", "int_type": "write a whole number",
                "float_type": "write a number", "string_type": "", "list_type": "write a list, [...]",
                "dict_type": "write a table, { key = value }"}
UNION_TAG = re.compile(r"bool|int|float|str|none|list\[.*\]|dict\[.*\]|literal\[.*\]|function-\w+\[.*\]|is-instance\[.*\]")


def refusal(msg: str, source: str, set_keys: list[str] = ()) -> str:
    """One line for a refusal whose message starts with its dotted key, named like a schema error: the
    file, or the `--set` that gave the key."""
    lead = re.match(r"[\w.]*", msg).group().rstrip(".")
    given = lead and any(k == lead or k.startswith(lead + ".") or lead.startswith(k + ".") for k in set_keys)
    return f"--set {msg}" if given else f"{source}: {msg}"


def apply_override(data: dict[str, Any], item: str) -> None:
    """`trainer.lr=1e-5` -> data["trainer"]["lr"] = 1e-5. Values parse as TOML, else as strings."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. --set trainer.lr=1e-5")
    parts = key.strip().split(".")
    if not all(p.strip() for p in parts):
        raise RecipeError(f"--set {item!r}: {key.strip()!r} is not a dotted key, e.g. --set trainer.lr=1e-5")
    node = data
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or unset in a recipe.json read back (an eval set's env)
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise RecipeError(f"--set {key}: {part} is a value, not a table of keys")
    node[parts[-1]] = parse_value(raw.strip())


def parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
