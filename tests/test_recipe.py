"""Recipes: every shipped recipe parses; bad ones fail before anything starts, naming key and file."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, prl_cmd
from prl.launch.checks import load
from prl.recipe import RecipeError, load_recipe
from prl.recipe.schema import TaskCfg

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_parse(path):
    load(path)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,key,words", [
    ("[trainer]\nlrr = 1e-3\n", "trainer.lrr", "unknown key"),
    ("[trainer]\nlr = 'fast'\n", "trainer.lr", "valid number"),
    ("[rl]\nbatch_size = 60\ngroup_size = 8\n", "rl.batch_size", "divisible"),
    ("[rl]\nmax_off_policy_steps = -1\n", "rl.max_off_policy_steps", "greater than or equal"),
    ("[bogus]\nx = 1\n", "bogus", "unknown key"),
    ("[inference]\nnum_servers = 2\nprefill_servers = 1\n", "inference", "set inference.kv_pool.enabled"),
    ("[inference]\nprefill_servers = 1\n[inference.kv_pool]\nenabled = true\n", "inference",
     "at least one of inference.num_servers (1) to decode"),
    ("[inference.kv_pool]\nmemory_gb = 0\n", "inference.kv_pool.memory_gb", "greater than 0"),
    ("[inference.kv_pool]\nenabled = true\nhost = 'h1'\n", "inference.kv_pool.host", "names a cluster host"),
    ("[inference]\nbackend = 'vllm'\ncompile = true\n", "inference", "compiles by its own options"),
    ("[inference]\ncompile = true\n[trainer]\nrouter_replay = true\n", "trainer.router_replay", "eager forwards"),
    ("[trainer]\nshare_prompts = true\nnproc = 2\n[trainer.parallel]\ncp = 2\n", "trainer", "needs trainer.parallel.cp = 1"),
    ("[trainer]\nnproc = 2\n[trainer.parallel]\ncp = 2\n[trainer.loss]\nnormalize = 'sequence'\n", "trainer",
     "sequence normalisation divides by the whole sample's loss tokens"),
])
def test_bad_recipe_names_key_and_file(tmp_path, text, key, words):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and words in msg


@pytest.mark.parametrize("text,words", [
    ("[env]\nkind = 'bogus'\n", "env.kind: 'bogus' is neither a built-in environment"),
    ("[eval.h.env]\nkind = 'no_such_module:Env'\n", "eval.h.env.kind: 'no_such_module:Env': no module named"),
    ("[inference]\nbackend = 'sglang'\n", "inference.backend = 'sglang': unknown backend"),
    ("[inference]\nkv_cache_dtype = 'fp8'\n", "inference.kv_cache_dtype: only used with inference.backend = 'vllm'"),
    ("[model]\narch = 'qwen3_moe'\n[trainer]\nnproc = 2\n[trainer.parallel]\ncp = 2\n",
     "trainer.parallel.cp > 1: context parallelism is built for GLM-5"),
    ("[model]\nfirst_dense_layers = 3\n[trainer.lora]\nrank = 4\ntargets = ['shared_experts']\n",
     "trainer.lora.targets = ['shared_experts']: model.arch 'glm_moe_dsa' with model.first_dense_layers = 3"),
    ("[model]\nmax_position_embeddings = 20\n", "model.max_position_embeddings (20) is shorter than the longest sample"),
    ("[trainer]\nmicro_batch_tokens = 20\n", "trainer.micro_batch_tokens (20) must hold one whole sample"),
    ("[rl]\ncredit = 'turn'\n", "rl.credit = 'turn' needs a multi-turn environment"),
    ("[eval.h.env]\nkind = 'code'\n", "eval.h.env: env.kind = 'code' runs model-written code"),
])
def test_what_needs_a_class_is_checked_at_launch_naming_key_and_file(tmp_path, text, words):
    """The schema validates data only (it imports no environment, family or backend); the launch's checks refuse
    the rest, each in one line naming the file (or the --set) and the key."""
    path = write(tmp_path, text)
    load_recipe(path)
    with pytest.raises(RecipeError) as e:
        load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and words in msg and "\n" not in msg, msg
    key = words.partition(":")[0].partition(" ")[0]
    if "eval" not in key:
        with pytest.raises(RecipeError, match=f"^--set {re.escape(key)}"):
            load(write(tmp_path, ""), [line.replace(" ", "") for line in dotted(text)])


def dotted(text: str) -> list[str]:
    """A small TOML text as --set overrides (tables of scalars and lists only)."""
    out, table = [], ""
    for line in text.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
        elif line:
            k, _, v = line.partition(" = ")
            out.append(f"{table}.{k}={v}")
    return out


def test_the_tiny_architectures_are_the_families_with_a_tiny_spec():
    import typing

    from prl.model.families import with_feature
    from prl.recipe.schema import ModelCfg

    assert list(typing.get_args(ModelCfg.model_fields["arch"].annotation)) == with_feature("tiny")


def test_lora_targets_a_tiny_dense_model_lacks_are_refused_before_launch(tmp_path):
    """Shared experts sit in the MoE layers: a model whose every layer is dense has none."""
    for extra in (["--dry-run"], ["--no-tui", "--set", f"run.output_dir={tmp_path}/runs"]):
        p = subprocess.run(prl_cmd("run", ROOT / "recipes/reverse-tiny-lora.toml", "--set", "model.first_dense_layers=3",
                                   "--set", "model.num_layers=3", "--set", "trainer.lora.targets=['shared_experts']",
                                   "--set", "trainer.router_replay=false", *extra),
                           capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        named = [line for line in out.splitlines() if "trainer.lora.targets" in line]
        assert p.returncode == 2 and len(named) == 1 and "has no module in these groups" in named[0], out
        assert "Traceback" not in out
    assert not (tmp_path / "runs").exists()


def test_set_overrides_are_typed(tmp_path):
    r = load_recipe(write(tmp_path, ""), ["trainer.lr=1e-5", "rl.max_steps=3", "run.name=abc", "trainer.loss.correction=mask"])
    assert r.trainer.lr == 1e-5 and r.rl.max_steps == 3 and r.run.name == "abc" and r.trainer.loss.correction == "mask"
    with pytest.raises(RecipeError, match="trainer.lrx"):
        load_recipe(write(tmp_path, ""), ["trainer.lrx=1"])
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        load_recipe(write(tmp_path, ""), ["trainer.lr"])


@pytest.mark.parametrize("text,key,words", [
    ("[inference]\ncompile = 'yes'\n", "inference.compile", "got the string 'yes': write true or false"),
    ("[rl]\nmax_steps = '10'\n", "rl.max_steps", "valid integer (got the string '10'"),
    ("[rl]\nmax_steps = 10.0\n", "rl.max_steps", "valid integer (got float 10.0: write a whole number)"),
    ("[task]\nchat_template = 'yes'\n", "task.chat_template", "valid boolean (got the string 'yes': write true or false); "
                                                           "or Input should be 'auto'"),
    ("[trainer]\ncheckpoint_every = true\n", "trainer.checkpoint_every", "valid integer"),
])
def test_recipe_types_are_strict(tmp_path, text, key, words):
    """A quoted number, a "yes" or a float where an integer goes is refused with the type, never coerced;
    an integer where a float goes is a number."""
    with pytest.raises(RecipeError) as e:
        load_recipe(write(tmp_path, text))
    assert key in str(e.value) and words in str(e.value), str(e.value)
    assert load_recipe(write(tmp_path, "[trainer]\nlr = 1\n")).trainer.lr == 1.0
    with pytest.raises(RecipeError, match="^--set inference.compile: .*got the string 'yes'[^\\n]*$"):
        load_recipe(write(tmp_path, ""), ["inference.compile=yes"])


def test_eval_tables_start_from_the_recipes_task_and_env(tmp_path):
    """Setting one key of an eval set's [task] or [env] keeps the recipe's others; naming another task source or
    environment kind starts from the defaults (a task keeps only how prompts render)."""
    path = write(tmp_path, "[task]\nname = 'reverse'\nmin_len = 2\nmax_len = 5\nsystem_prompt = 'Be brief.'\n"
                           "[env]\nkind = 'tools'\ntools = ['prl.envs.tools:calculator']\nmax_turns = 3\n"
                           "[eval.a.task]\nreward = 'exact'\n[eval.a.env]\nmax_turns = 6\n"
                           "[eval.b.task]\nname = 'add'\n[eval.b.env]\nkind = 'single_turn'\n")
    r = load_recipe(path)
    a, b = r.eval["a"], r.eval["b"]
    assert (a.task.name, a.task.min_len, a.task.max_len, a.task.reward) == ("reverse", 2, 5, "exact")
    assert (a.env.kind, a.env.tools, a.env.max_turns) == ("tools", ["prl.envs.tools:calculator"], 6)
    assert (b.task.name, b.task.min_len, b.task.system_prompt) == ("add", TaskCfg().min_len, "Be brief.")
    assert (b.env.kind, b.env.max_turns) == ("single_turn", 4)
    own = load_recipe(write(tmp_path, "[task]\nname = 'custom'\ndataset = 'm:train'\nreward = 'm:score'\nmin_len = 2\n"
                                      "options = { tolerance = 0.1 }\n[eval.held.task]\ndataset = 'm:held'\n"
                                      "[eval.exact.task]\nreward = 'exact'\n"))
    held, exact = own.eval["held"].task, own.eval["exact"].task
    assert (held.name, held.dataset, held.reward, held.min_len, held.options) == ("custom", "m:held", "m:score", 3,
                                                                                  {"tolerance": 0.1})
    assert (exact.dataset, exact.reward, exact.options) == ("m:train", "exact", {"tolerance": 0.1}), "m:train takes them"


def test_set_reaches_a_table_a_read_back_recipe_leaves_unset():
    """`prl eval --set eval.h.env.max_turns=6` on a run's recipe.json, where the set's env is null; a key
    under a value is refused as --set's, not the file's."""
    from prl.recipe.load import apply_override

    data = {"eval": {"h": {"env": None, "examples": 4}}}
    apply_override(data, "eval.h.env.max_turns=6")
    assert data == {"eval": {"h": {"env": {"max_turns": 6}, "examples": 4}}}
    with pytest.raises(RecipeError) as e:
        apply_override(data, "eval.h.examples.x=1")
    assert str(e.value) == "--set eval.h.examples.x: examples is a value, not a table of keys"


def test_cli_rejects_bad_recipe_and_starts_nothing(tmp_path):
    path = write(tmp_path, f"[run]\nname = 'bad'\noutput_dir = '{tmp_path}/runs'\n[rl]\nbatch_size = 60\n")
    p = subprocess.run(prl_cmd("run", path, "--no-tui"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "rl.batch_size" in p.stderr and str(path) in p.stderr and "nothing was started" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_dry_run_prints_recipe_and_plan(tmp_path):
    p = subprocess.run(prl_cmd("run", ROOT / "recipes/reverse-tiny.toml", "--dry-run", "--set", "trainer.nproc=2"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "[trainer]" in out and "nproc = 2" in out
    for name in ("inference-0", "orchestrator", "trainer"):
        assert name in out
    assert "torch.distributed.run" in out and "--nproc-per-node=2" in out and "prl.inference" in out


def test_one_trainer_rank_runs_without_torchrun(tmp_path):
    """trainer.nproc = 1 on this machine: the rank is the process the driver starts (`--alone`), with no torchrun
    agent around it; two ranks go under torchrun."""
    from prl.launch.configs import resolve
    from prl.launch.processes import make_plan

    def trainer_cmd(nproc: int) -> list[str]:
        recipe = load_recipe(ROOT / "recipes/reverse-tiny.toml", [f"trainer.nproc={nproc}"])
        return next(s.cmd for s in make_plan(resolve(recipe, tmp_path), tmp_path) if s.role == "trainer")

    alone, two = trainer_cmd(1), trainer_cmd(2)
    assert alone[1:3] == ["-m", "prl.trainer"] and alone[-1] == "--alone", alone
    assert two[1:3] == ["-m", "torch.distributed.run"] and "--alone" not in two, two


@pytest.mark.parametrize("text,key,words", [
    ("[inference]\nbackend = 'vllm'\n[sampling]\ntop_p = 0.9\n", "sampling.top_p", "after top-p truncation"),
    ("[inference]\nbackend = 'vllm'\n[inference.vllm]\nport = 9\n", "inference.vllm.port", "prl sets --port itself"),
    ("[inference]\nbackend = 'vllm'\n[inference.vllm]\nlogprobs_mode = 'raw_logits'\n", "inference.vllm.logprobs_mode",
     "prl sets"),
    ("[inference.vllm]\nmax_num_batched_tokens = 64\n", "inference.vllm", "only used with inference.backend = 'vllm'"),
])
def test_bad_vllm_settings_name_the_key(tmp_path, text, key, words):
    with pytest.raises(RecipeError) as e:
        load(write(tmp_path, text))
    assert key in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("override,words", [
    ("model.head_dim=16", "attention kernel supports head sizes"),
    ("trainer.router_replay=true", "Model Runner V2"),
    ("model.arch='glm_moe_dsa'", "no sparse (DSA) attention"),
])
def test_what_vllm_cannot_do_on_cpu_is_refused_before_launch(tmp_path, override, words):
    """Checked by `--dry-run` and `prl run` alike, before any process starts (this machine has no GPU)."""
    from prl.launch.driver import gpu_present

    if gpu_present():
        pytest.skip("these refusals apply to CPU-only servers")
    for extra in (["--dry-run"], ["--no-tui", "--set", f"run.output_dir={tmp_path}/runs"]):
        p = subprocess.run(prl_cmd("run", ROOT / "recipes/reverse-tiny-vllm.toml", "--set", override, *extra),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and words in p.stdout + p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "runs").exists()


def test_a_gpu_backend_on_a_machine_without_a_gpu_is_refused_before_launch(tmp_path):
    from prl.launch.driver import gpu_present

    if gpu_present():
        pytest.skip("the refusal applies to a machine without a GPU")
    for extra in (["--dry-run"], ["--no-tui", "--set", f"run.output_dir={tmp_path}/runs"]):
        p = subprocess.run(prl_cmd("run", ROOT / "recipes/reverse-tiny.toml", "--set", "trainer.backend=nccl", *extra),
                           capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        assert p.returncode == 2 and "trainer.backend = 'nccl' needs an NVIDIA GPU" in out and "Traceback" not in out, out
    assert not (tmp_path / "runs").exists()


def test_a_broken_pretrained_folder_is_refused_before_launch(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    for extra in (["--dry-run"], ["--no-tui", "--set", f"run.output_dir={tmp_path}/runs"]):
        p = subprocess.run(prl_cmd("run", ROOT / "recipes/reverse-tiny.toml", "--set", f"model.path={folder}", *extra),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "model.safetensors" in p.stdout + p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "runs").exists()


def test_lora_targets_a_pretrained_folder_lacks_are_refused_before_launch(tmp_path):
    """Qwen3-MoE has no shared experts: found in the folder's tensor names, before any process starts."""
    from test_pretrained import make_pretrained

    from prl.model.families import folder_has_targets
    from prl.model.pretrained import check_pretrained

    folder = make_pretrained(tmp_path / "qwen3-tiny")
    info = check_pretrained(folder)
    assert folder_has_targets(info.model_type, info.names, info.num_experts, ["attention"])
    assert folder_has_targets(info.model_type, info.names, info.num_experts, ["routed_experts"])
    assert not folder_has_targets(info.model_type, info.names, info.num_experts, ["shared_experts"])
    for extra in (["--dry-run"], ["--no-tui", "--set", f"run.output_dir={tmp_path}/runs"]):
        p = subprocess.run(prl_cmd("run", ROOT / "recipes/reverse-tiny-lora.toml", "--set", f"model.path={folder}",
                                   "--set", "trainer.lora.targets=['shared_experts']", *extra),
                           capture_output=True, text=True, timeout=120)
        out = p.stdout + p.stderr
        assert p.returncode == 2 and "trainer.lora.targets" in out and "has no module in these groups" in out, out
        assert "Traceback" not in out
    assert not (tmp_path / "runs").exists()


def test_cli_help_names_tables_and_the_workstation_side_stays_torch_free():
    import sys

    p = subprocess.run(prl_cmd("--help"), capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0 and "Usage: prl " in p.stdout and "with [cluster], every host" in p.stdout, p.stdout
    code = "import sys, prl.launch.driver, prl.launch.cluster, prl.launch.doctor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", "the driver must not import torch (it costs seconds before prl run prints)"


def test_dry_run_checks_what_run_checks(tmp_path):
    """A custom task whose module does not exist is refused by --dry-run too, before anything starts."""
    path = write(tmp_path, "[task]\nname = 'custom'\ndataset = 'no_such_module:data'\nreward = 'no_such_module:score'\n")
    for extra in (["--dry-run"], ["--no-tui", "--set", f"run.output_dir={tmp_path}/runs"]):
        p = subprocess.run(prl_cmd("run", path, *extra), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "no_such_module" in p.stdout + p.stderr, p.stdout + p.stderr
    assert not (tmp_path / "runs").exists()


def test_wandb_without_a_login_or_package_is_refused_before_launch(tmp_path, monkeypatch):
    """Online W&B needs a login (WANDB_API_KEY or the netrc entry `wandb login` writes); both commands
    refuse the recipe before anything starts. Without the package, the error says how to install it."""
    import sys

    from prl.launch.wandb_log import WandbError, check_wandb

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "NETRC"))} | {"HOME": str(home)}
    online = ["--set", 'run.wandb={project="p"}']
    for extra in (["--dry-run"], ["--no-tui", "--set", f"run.output_dir={tmp_path}/runs"]):
        p = subprocess.run(prl_cmd("run", ROOT / "recipes/reverse-tiny.toml", *online, *extra),
                           capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 2 and "wandb login" in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "runs").exists()
    recipe = load_recipe(ROOT / "recipes/reverse-tiny.toml", ['run.wandb={project="p"}'])
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("NETRC", raising=False)
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    check_wandb(recipe)  # logged in the way `wandb login` leaves it
    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does when the package is absent
    with pytest.raises(WandbError, match="pip install wandb"):
        check_wandb(recipe)


@pytest.mark.parametrize("extra, words", [
    (["trainer.parallel.cp=2"], ["context parallelism is built for GLM-5", "qwen3_moe"]),
    (["trainer.parallel.ep=2", "trainer.parallel.cp=1", "trainer.nproc=2"], ["must divide the routed experts"]),
], ids=["cp-on-qwen3", "ep-not-dividing"])
def test_parallel_layout_is_checked_against_a_pretrained_folder(tmp_path, extra, words):
    """The folder's config decides (the tiny-model keys do not apply): checked before launch."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from test_pretrained import make_pretrained

    folder = make_pretrained(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["num_local_experts" if "num_local_experts" in config else "num_experts"] = 3 if "ep=2" in " ".join(extra) else 8
    (folder / "config.json").write_text(json.dumps(config))
    sets = [x for e in ["trainer.nproc=2", f"model.path={folder}", *extra] for x in ("--set", e)]
    p = subprocess.run(prl_cmd("run", ROOT / "recipes/reverse-tiny.toml", "--dry-run", *sets),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and all(w in p.stdout + p.stderr for w in words), p.stdout + p.stderr


def test_kv_pool_settings_not_built_are_refused_before_launch(tmp_path):
    """The pool's RDMA transport is a valid setting `prl run` refuses, naming it; a relative disk
    tier folder is a bad recipe."""
    path = write(tmp_path, "[inference.kv_pool]\nenabled = true\nprotocol = 'rdma'\n")
    p = subprocess.run(prl_cmd("run", path, "--no-tui"), capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "protocol = 'rdma'" in out, out
    with pytest.raises(RecipeError, match="inference.kv_pool.disk_path"):
        load_recipe(write(tmp_path, "[inference.kv_pool]\nenabled = true\ndisk_path = 'nvme/pool'\n"))
