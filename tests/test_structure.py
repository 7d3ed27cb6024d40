"""The shape of the code: no circle of files, no import from a lower folder to a higher one, short functions.

A file's imports are what loading it loads: every `import` statement, also those inside functions (a lazy
import is still a dependency), every `importlib.import_module("prl....")` of a literal name, and every
"prl.module:attribute" string (what the backend registry and the environment seam load by name). A
module's floor is its folder's (a file at the top of `prl/` is a folder of its own): no module has a floor
of its own, so an import that runs up a floor cannot hide behind one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "prl"

# a folder may import its own floor or below; the config layer (recipe) sits under all it configures
FLOORS = {
    "metrics": 0, "system": 0, "parallel_dims": 0, "usercode": 0,
    "recipe": 1,
    "model": 2, "tasks": 2, "transport": 2, "sandbox": 2,
    "inference": 3, "trainer": 3, "backends": 3, "envs": 3,
    "orchestrator": 4, "evaluation": 4, "tui": 4, "sizing": 4,
    "launch": 5,
    "report": 6, "report_data": 6, "report_png": 6,
    "cli": 7, "__main__": 7, "prl": 7,
}
BY_NAME = re.compile(r"prl(\.\w+)+:\w+")  # "module:attribute", loaded with importlib
MAX_FUNCTION_LINES = 60


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        name = ".".join(p.relative_to(root.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def named(node: ast.AST) -> list[str]:
    """The prl modules `node` names: an import statement, `import_module("prl.x")`, a "prl.x:attr" string."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "prl":
        return [f"{node.module}.{a.name}" for a in node.names]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "prl"]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
        arg = node.args[0] if node.args else None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.split(".")[0] == "prl":
            return [arg.value]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and BY_NAME.fullmatch(node.value):
        return [node.value.partition(":")[0]]
    return []


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in mods.items():
        found = {owner(n) for node in ast.walk(ast.parse(path.read_text())) for n in named(node)}
        graph[name] = found - {name, "prl", ""}
    return graph


def folder(module: str) -> str:
    """`prl.backends.vllm.spec` -> "backends"; a top-level file is its own folder; `prl` itself is "prl"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floor(module: str) -> int:
    return FLOORS[folder(module)]


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})" for a, bs in sorted(graph.items())
            for b in sorted(bs) if floor(b) > floor(a)]


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


def test_no_circle_of_files():
    assert cycles(imports(modules())) == []


def test_no_import_runs_up_a_floor():
    assert upward(imports(modules())) == []


def test_every_folder_has_a_floor():
    assert {folder(m) for m in modules()} == set(FLOORS)


def test_every_function_is_short():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


SYNTHETIC = {  # the circle the schema once made, each edge of a kind a statement-only reading misses or counts
    "prl/recipe/schema.py": 'def envs():\n    import importlib\n\n    return importlib.import_module("prl.envs")\n',
    "prl/envs/__init__.py": "def make_env():\n    from prl.tasks import make_task\n",
    "prl/tasks/__init__.py": "from prl.recipe.schema import TaskCfg\n",
    "prl/backends/registry.py": 'SPECS = {"embedded": "prl.backends.embedded_spec:SPEC"}\n',
    "prl/backends/embedded_spec.py": "import prl.model.families\n",
    "prl/model/families.py": "",
}


def test_the_checks_can_fail(tmp_path):
    """On a small tree of files: a circle closed by `importlib.import_module`, an upward import it hides, a
    module loaded by a "module:attribute" string, and floors judged by folder."""
    for rel, text in SYNTHETIC.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = imports(modules(tmp_path / "prl"))
    assert graph["prl.backends.registry"] == {"prl.backends.embedded_spec"}
    assert cycles(graph) == [["prl.envs", "prl.recipe.schema", "prl.tasks"]]
    assert upward(graph) == ["prl.recipe.schema (floor 1) imports prl.envs (floor 3)"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floor("prl.backends.registry") == floor("prl.backends.vllm.spec") > floor("prl.recipe.schema")
    assert floor("prl.model.families") == floor("prl.model.lora") > floor("prl.recipe.schema")
    assert floor("prl.launch.hosts") > floor("prl.trainer.trainer") > floor("prl.parallel_dims")
