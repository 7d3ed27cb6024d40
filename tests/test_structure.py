"""The shape of the code: no import circles, no import that runs back up a floor, short functions.

Every `import` statement counts, also those inside functions (a lazy import is still a dependency).
Modules that the registry loads by name (`prl.backends.registry.SPECS`) are not imported by a
statement and are checked like any other module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "prl"

# a module may import modules of its own floor or below (longest prefix wins)
FLOORS = {
    "prl.metrics": 0, "prl.system": 0, "prl.parallel_dims": 0, "prl.backends.registry": 0, "prl.model.families": 0,
    "prl.recipe": 1,
    "prl.model": 2, "prl.tasks": 2, "prl.transport": 2, "prl.sizing": 2, "prl.sandbox": 2,
    "prl.inference": 3, "prl.trainer": 3, "prl.backends": 3, "prl.envs": 3,
    "prl.orchestrator": 4, "prl.evaluation": 4, "prl.tui": 4,
    "prl.launch": 5,
    "prl.report": 6, "prl.report_data": 6, "prl.report_png": 6,
    "prl.cli": 7, "prl.__main__": 7, "prl": 7,
}
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "prl":
                found |= {owner(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names if a.name.split(".")[0] == "prl"}
        graph[name] = found - {name, "prl"}
    return graph


def floor(module: str) -> int:
    name = module
    while name not in FLOORS:
        name = name.rpartition(".")[0]
    return FLOORS[name]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(imports(modules())) == []


def test_no_import_runs_back_up_a_floor():
    graph = imports(modules())
    up = [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})" for a, bs in sorted(graph.items())
          for b in sorted(bs) if floor(b) > floor(a)]
    assert up == []


def test_every_function_is_short():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_the_checks_can_fail():
    """The circle and floor checks find what they are meant to find."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floor("prl.trainer.trainer") > floor("prl.recipe.schema") > floor("prl.backends.registry")
    assert floor("prl.launch.hosts") > floor("prl.trainer.trainer")
