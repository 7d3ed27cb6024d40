"""The recipe schema: one pydantic model per TOML section.

Pure data and the checks that need no project module: it imports nothing of what it configures (no
environment, task, model family or backend), and no torch. The checks that need the classes a recipe
names (the environment's seam and workload, a family's spec, a backend's refusals) run where the run is
launched, `prl.launch.checks`. Every model forbids unknown keys; validators only check, they never
rewrite the config (derived values live in `prl.recipe.resolve`).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prl.parallel_dims import ParallelDims

# a user's function or class, "module:name" (task.dataset, task.reward, env.tools, env.kind, `prl.envs`)
CALLABLE = r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"
TASK_NAMES = ("reverse", "reverse_long_tail", "sort", "add")  # prl.tasks.builtin.BUILTIN
CHECKERS = ("exact", "math", "choice")  # task.reward by name: prl.tasks.checkers.CHECKERS


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True, strict=True)


class WandbCfg(Section):
    """Log the run to Weights & Biases (the driver logs every process's metrics to one W&B run)."""

    project: str = Field(min_length=1)
    """The W&B project the run logs to."""
    entity: str | None = None
    """The W&B team or user; unset: your default entity."""
    mode: Literal["online", "offline"] = "online"
    """How W&B logs: "online" as the run goes; "offline" to files under RUN_DIR/wandb for `wandb sync` later."""
    name: str | None = None
    """The W&B run's display name; unset: run.name."""
    group: str | None = None
    """The W&B group the run is filed under, to compare runs together; unset: none."""
    tags: list[str] = []
    """Tags on the W&B run."""


class RunCfg(Section):
    name: str = Field("run", pattern=r"^[A-Za-z0-9._-]+$")
    """The run's name: its folder is run.output_dir/NAME (letters, digits, `.`, `_`, `-`; not `.` or `..`)."""
    output_dir: str = "runs"
    """The folder runs are made in, relative to where `prl` is started."""
    seed: int = 0
    """Seed of the task's examples, the tiny model's random init and the servers' sampling."""
    max_restarts: int = Field(3, ge=0)
    """Faults: a process that dies or hangs is restarted up to this many times (the trainer's ranks count as one); past
    it, or with 0, the run stops and names it."""
    hang_timeout_s: float = Field(60.0, ge=5)
    """Seconds: a server or trainer endpoint that answers nothing, or an orchestrator that logs nothing, for this long
    is hung: it is killed and restarted."""
    wandb: WandbCfg | None = None
    """Log the run to Weights & Biases; off unless set, e.g. wandb = { project = "rl", mode = "offline" }."""
    samples_per_step: int = Field(4, ge=0)
    """Rollouts of each step kept as text in RUN_DIR/samples/steps.jsonl (the step's best and worst by reward, then
    others), which `prl samples RUN` prints; 0 keeps none."""

    @field_validator("name")
    @classmethod
    def _a_folder_of_its_own(cls, v: str) -> str:
        if v in (".", ".."):
            raise ValueError(f"run.name = {v!r} names no folder of its own under run.output_dir: give the run a name")
        return v


class ModelCfg(Section):
    """A tiny model built from a transformers config with random init, or a pretrained local HF folder.

    With `path`, every process loads that folder's weights (`model.safetensors`, or shards listed in
    `model.safetensors.index.json`); the tiny-model keys below are then unused."""

    arch: Literal["glm_moe_dsa", "qwen3_moe"] = "glm_moe_dsa"  # prl.model.families.with_feature("tiny")
    """The model family: what a tiny model is built as (`prl.model.tiny`); with `path`, what `prl plan` assumes when
    the folder is not on this machine."""
    path: str | None = None
    """A local Hugging Face folder with weights; on a cluster, at this path on every host. Unset: a tiny random-init
    model shaped by the keys below."""
    hidden_size: int = Field(128, gt=0)
    """Tiny model: width of the residual stream."""
    num_layers: int = Field(3, gt=0)
    """Tiny model: decoder layers."""
    first_dense_layers: int = Field(1, ge=0)
    """Tiny model: leading layers with a dense MLP instead of experts (num_layers or more: a dense model)."""
    num_heads: int = Field(4, gt=0)
    """Tiny model: attention heads (Qwen3-MoE: half as many key/value heads)."""
    head_dim: int = Field(32, gt=0, multiple_of=2)
    """Tiny model: dimension of one attention head, even; GLM-5's MLA: qk_nope = v = head_dim, rope = head_dim / 2."""
    num_experts: int = Field(8, gt=0)
    """Tiny model: routed experts per MoE layer."""
    experts_per_token: int = Field(2, gt=0)
    """Tiny model: routed experts each token goes to (at most num_experts)."""
    expert_dim: int = Field(128, gt=0)
    """Tiny model: hidden size of each expert's MLP."""
    dense_dim: int = Field(256, gt=0)
    """Tiny model: hidden size of the dense layers' MLP."""
    index_topk: int = Field(256, gt=0)
    """Tiny GLM-5 model: keys each query attends to, picked by the DSA indexer (the sequence length or more: every
    key)."""
    max_position_embeddings: int = Field(512, gt=0)
    """Tiny model: positions it holds, which must fit the longest sample (prompt and completion); a pretrained folder's
    own value is used instead."""

    @model_validator(mode="after")
    def _experts(self):
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"model.experts_per_token ({self.experts_per_token}) exceeds model.num_experts "
                f"({self.num_experts}); lower experts_per_token or raise num_experts"
            )
        return self


def check_rows(v: list[int] | None) -> list[int] | None:
    if v is not None and (len(v) != 2 or not 0 <= v[0] < v[1]):
        raise ValueError(f"rows = {v}: give [start, end) with 0 <= start < end, e.g. [0, 9000]")
    return v


class TaskCfg(Section):
    """Built-in task by name, a reasoning-gym task as `reasoning_gym:<name>` (the `envs` extra; the
    name and options are checked when `prl run` imports the task), user functions as `module:function`, or a
    dataset file (`data`, docs/data.md)."""

    name: str = "reverse"
    """A built-in task (reverse, reverse_long_tail, sort, add), "custom" (task.dataset and task.reward), "file" (the
    examples of task.data, which also implies it), or `reasoning_gym:<name>`."""
    dataset: str | None = Field(None, pattern=rf"^{CALLABLE}$")
    """A dataset function as "module:function" ((index, seed, min_len, max_len) -> {"prompt", "answer", ...}); replaces
    the named task's dataset; needed by name = "custom"."""
    reward: str | None = None
    """The reward: a checker of answers by name ("exact", "math", "choice": docs/data.md) or a function as
    "module:function" ((completion, example) -> a float in [0, 1], or (reward, answer)); replaces the named task's
    reward; needed by name = "custom" and by task.data."""
    data: str | None = None
    """A dataset file, one example a row: .jsonl, .json (a list of objects), .parquet, .csv, or a folder written by
    Hugging Face datasets' save_to_disk; a path on this machine (on a cluster, on the orchestrator's and trainer's
    hosts), nothing is downloaded. Shuffled per epoch by run.seed; rl.max_steps past one epoch starts another."""
    prompt_key: str = Field("prompt", min_length=1)
    """With task.data: the column holding the prompt, a string or a list of chat messages ({role, content})."""
    answer_key: str = Field("answer", min_length=1)
    """With task.data: the column holding the reference answer the checkers compare with (example["answer"]); the
    row's other columns reach the reward as they are."""
    rows: list[int] | None = None
    """With task.data: the rows used, [start, end) counted from 0 (unset: every row), e.g. to keep the file's last
    rows for an eval set."""
    shuffle: bool = True
    """With task.data: draw the rows in an order shuffled per epoch by run.seed (false: file order). Eval sets read
    their rows in file order."""
    chat_template: bool | Literal["auto"] = "auto"
    """Single-turn prompts: render the prompt with the tokenizer's chat template (the user's message, then the
    assistant's turn begins) - true, false, or "auto" (when the tokenizer has one; prl's tiny tokenizer has none)."""
    system_prompt: str | None = None
    """With the chat template: a system message before every prompt (a prompt's own system message is kept)."""
    max_prompt_tokens: int = Field(512, gt=0)
    """With task.data: the longest prompt in tokens, which the length checks and `prl plan` size from; a row whose
    prompt is longer is skipped and counted (`skipped_examples`)."""
    min_len: int = Field(3, gt=0)
    """Shortest problem, passed to the dataset function (built-ins: letters of the word; add: digits of an operand, at
    most 4; reverse_long_tail: the median)."""
    max_len: int = Field(8, gt=0)
    """Longest problem, in min_len's unit; prl also sizes the longest prompt from it (2 tokens a character plus 8) to
    check that a sample fits."""
    options: dict[str, Any] = {}
    """reasoning_gym tasks: the dataset's config, e.g. { size = 500, min_digits = 2 }. With the user's own
    `task.dataset` or `task.reward` function: keyword arguments passed to each of them (a function that does not take
    one is refused at launch), e.g. { tolerance = 0.01 }."""

    @field_validator("name")
    @classmethod
    def _known_name(cls, v: str) -> str:
        """Built-ins by name; `reasoning_gym:<name>` by shape only (importing reasoning-gym takes seconds)."""
        rg = v.partition(":")[2] if v.startswith("reasoning_gym:") else None
        if v in (*TASK_NAMES, "custom", "file") or (rg and rg.replace("_", "a").isalnum() and rg.isascii()):
            return v
        raise ValueError(f"task.name = {v!r}: one of {', '.join(TASK_NAMES)}, custom, file, or reasoning_gym:<name>")

    @field_validator("reward")
    @classmethod
    def _reward(cls, v: str | None) -> str | None:
        if v is None or v in CHECKERS or re.fullmatch(CALLABLE, v):
            return v
        raise ValueError(f"task.reward = {v!r}: a checker ({', '.join(CHECKERS)}) or a function as 'module:function'")

    @field_validator("rows")
    @classmethod
    def _rows(cls, v: list[int] | None) -> list[int] | None:
        return check_rows(v)

    def is_file(self) -> bool:
        return self.data is not None

    def longest_prompt(self) -> int:
        """The longest prompt in tokens: a data file's max_prompt_tokens, else sized from max_len (about 2 tokens a
        character plus the framing)."""
        return self.max_prompt_tokens if self.is_file() else self.max_len * 2 + 8

    def same_data(self, other: "TaskCfg") -> bool:
        """Whether `other` draws the same examples at the same index (its reward may differ)."""
        keys = ("name", "dataset", "min_len", "max_len", "options", "data", "rows", "shuffle", "prompt_key")
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_len > self.max_len:
            raise ValueError(f"task.min_len ({self.min_len}) must be <= task.max_len ({self.max_len})")
        if self.name == "custom" and not (self.dataset and self.reward):
            raise ValueError("task.name = 'custom' needs task.dataset and task.reward as 'module:function'")
        if self.options and not takes_options(self.name, self.dataset, self.reward):
            raise ValueError(f"task.options is for reasoning_gym tasks and the user's task.dataset and task.reward "
                             f"functions; task.name = {self.name!r} has none")
        self._check_file()
        return self

    def _check_file(self) -> None:
        if self.name == "file" and self.data is None:
            raise ValueError("task.name = 'file' needs task.data, the path of a dataset file")
        if self.data is None:
            if self.rows is not None:
                raise ValueError("task.rows is for a dataset file (task.data); set task.data or drop it")
            return
        if self.name not in ("file", TaskCfg.model_fields["name"].default):
            raise ValueError(f"task.data gives the examples: drop task.name = {self.name!r} (or set it to 'file')")
        if self.dataset:
            raise ValueError("task.data and task.dataset both give the examples: keep one")
        if self.reward is None:
            raise ValueError(f"task.data needs task.reward: a checker ({', '.join(CHECKERS)}) or 'module:function'")


class SftCfg(Section):
    """Supervised warm start run by the trainer before RL (steps = 0 skips it).

    Unset, it is 40 steps for a tiny random-init model and off for a pretrained `model.path`."""

    steps: int | None = Field(None, ge=0)
    """Warm-start steps before RL (0: none); unset: 40 for a tiny random-init model, 0 for a pretrained model.path."""

    def steps_for(self, model: "ModelCfg") -> int:
        if self.steps is not None:
            return self.steps
        return 0 if model.path else 40
    batch_size: int = Field(32, gt=0)
    """Demonstrations per warm-start step."""
    lr: float = Field(3e-3, gt=0)
    """Warm-start learning rate (AdamW, with trainer.warmup_steps and trainer.schedule over the warm-start steps)."""
    data: str | None = None
    """Demonstrations from a dataset file (formats as task.data): rows of task.prompt_key and completion_key (each a
    string, or chat messages), or of messages_key (a conversation); the loss is on the completion (every assistant
    message) only. Unset: the task's own demonstrations (its answers). Shuffled per epoch by the warm start's seed
    (run.seed + 7919)."""
    completion_key: str = Field("completion", min_length=1)
    """With sft.data: the column holding what the model learns to write."""
    messages_key: str = Field("messages", min_length=1)
    """With sft.data: the column holding a whole conversation (a row without task.prompt_key)."""

    @model_validator(mode="after")
    def _data_steps(self):
        if self.data is not None and self.steps is None:
            raise ValueError("sft.data needs sft.steps: the warm-start steps to take (one epoch is the file's rows / "
                             "sft.batch_size)")
        return self


class SandboxCfg(Section):
    """Where model-written code runs (`prl.sandbox`): its own uid and namespaces, limits, a pool."""

    isolation: Literal["namespaces", "none"] = "namespaces"
    """How executions are walled off: "namespaces" (bubblewrap's mount, pid, network, ipc and uts namespaces around the
    uid and rlimits) or "none" (rlimits and the uid only; shown, warned)."""
    timeout_s: float = Field(5.0, gt=0)
    """Seconds of wall clock one execution may take before it is stopped."""
    memory_mb: int = Field(256, gt=0)
    """MiB of address space per process (RLIMIT_AS); the execution's memory.max where a cgroup is available."""
    max_procs: int = Field(16, gt=0)
    """Processes one execution may have at once (RLIMIT_NPROC of its own uid; pids.max with a cgroup)."""
    max_output_bytes: int = Field(4096, gt=0)
    """Bytes an execution may write to stdout, and to stderr; past it the program is stopped."""
    concurrency: int = Field(2, gt=0)
    """Executions at once in each sandbox worker (programs in parallel per worker, not workers)."""
    workers: int = Field(1, gt=0)
    """Sandbox worker processes on one machine (a cluster: one per sandbox host, placement.sandbox)."""


def takes_options(name, dataset, reward) -> bool:
    """Whether a task has functions that take `task.options`: reasoning-gym's, or the user's own dataset or reward
    ("module:function"; a checker by name takes none)."""
    return str(name).startswith("reasoning_gym:") or bool(dataset) or ":" in str(reward or "")


class EnvCfg(Section):
    """The environment a rollout runs in (`prl.envs`): one turn (today's tasks), turns with tools, or
    turns whose code runs in the sandbox. Per turn the model samples up to `sampling.max_tokens`. The class
    `kind` names is asked what it needs (`prl.envs.env_class`), never the name; it is checked at launch."""

    kind: str = "single_turn"
    """The environment: "single_turn" (one completion per prompt), "tools" (turns that call env.tools), "code" (turns
    whose programs run in the sandbox), or your own environment class as "module:Class"."""
    max_turns: int = Field(4, gt=0)
    """Multi-turn environments: model turns a trajectory takes at most."""
    max_total_tokens: int = Field(512, gt=0)
    """Multi-turn environments: model and environment tokens after the prompt; the trajectory ends when
    they reach it."""
    tools: list[str] = []
    """kind = "tools": the Python functions the model may call, as "module:function"."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """kind = "tools": seconds a tool call may take; past it the model gets a timeout error."""
    max_env_chars: int = Field(512, gt=0)
    """A tool result or program output is cut at this many characters, with a marker."""
    format: Literal["auto", "tiny", "chat"] = "auto"
    """How turns look in tokens: "chat" (the tokenizer's chat template, tool calls as `<tool_call>{json}</tool_call>`),
    "tiny" (prl's character-level format); "auto": chat when the tokenizer has a chat template."""
    language: Literal["minilang", "python"] = "minilang"
    """kind = "code": what the model writes ("minilang": prl's tiny print language; "python": a Python code block in
    Markdown)."""
    attempt_penalty: float = Field(0.0, ge=0, le=0.25)
    """kind = "code": a program passing at attempt k scores 1 - attempt_penalty * (k - 1) (at least 0), so passing at
    once beats passing after feedback (which still beats failing, at most half the output's similarity, within
    1 + 0.5 / attempt_penalty attempts)."""
    fail_credit: float = Field(0.5, ge=0, le=0.5)
    """kind = "code": a failing program scores this times its output's similarity to the target (0: pass or
    fail only)."""
    sandbox: SandboxCfg = SandboxCfg()
    """kind = "code": where the programs run (limits, workers)."""
    options: dict[str, Any] = {}
    """Your own environment class ("module:Class"): its settings, read in `from_context` as `ctx.cfg.options`
    (e.g. { hint_every = 2 })."""
    on_error: Literal["stop", "drop"] = "stop"
    """When your own code (a task's dataset or reward, an environment's methods) raises or returns what prl cannot use
    during the run: "stop" ends the run at once in one line naming the function, file, line and example, written to
    user_error.json in the run folder; "drop" drops that example (counted as `user_errors`) and stops only past
    max_error_share. prl's own failures restart as before; a failing demonstration of the warm start always stops."""
    max_error_share: float = Field(0.1, gt=0, lt=1)
    """on_error = "drop": the run stops once more than this share of the examples ended were dropped (counted from the
    20th example on)."""

    @model_validator(mode="after")
    def _tools(self):
        if self.options and ":" not in self.kind:
            raise ValueError(f"env.options is for your own environment class (env.kind = 'module:Class'); "
                             f"env.kind = {self.kind!r} has none")
        if self.kind == "tools" and not self.tools:
            raise ValueError("env.kind = 'tools' needs env.tools, e.g. ['mypkg.tools:lookup']")
        bad = [t for t in self.tools if not re.fullmatch(CALLABLE, t)]
        if bad:
            raise ValueError(f"env.tools: {bad[0]!r} is not 'module:function'")
        return self


class RlCfg(Section):
    max_steps: int = Field(30, ge=0)
    """RL steps (trainer optimizer steps) of the run; trainer.schedule spans them."""
    batch_size: int = Field(64, gt=0)
    """Samples (completions) per trainer step; a multiple of group_size."""
    group_size: int = Field(8, gt=0)
    """Completions per prompt, compared with each other for the advantage."""
    max_async_level: int = Field(1, ge=0)
    """Steps inference may run ahead of the trainer (0: each step samples with the newest weights)."""
    max_off_policy_steps: int = Field(2, ge=0)
    """Tokens sampled more than this many versions ago follow stale_policy (counted)."""
    overprovision: float = Field(0.0, ge=0, le=8)
    """Partial rollouts: start this share of a step's groups beyond what max_async_level allows; each step trains the
    first groups to finish and the rest carry on under new weights (prl.orchestrator)."""
    stale_policy: Literal["mask", "correct", "drop"] = "mask"
    """Tokens older than max_off_policy_steps: "mask" (not trained; the rest of the trajectory is), "correct" (trained,
    trainer.loss.correction corrects them), "drop" (the whole group is dropped and replaced);
    prl.orchestrator.buffer."""
    max_inflight_rollouts: int = Field(64, gt=0)
    """Rollouts in flight at most, over all servers; below it, the servers' KV usage decides (kv_usage_target)."""
    kv_usage_target: float = Field(0.9, ge=0, le=1)
    """A server whose KV usage (share of its KV capacity) is above this has its rollout limit halved, one below it
    raised by a group (prl.orchestrator.budget); 0: always the cap."""
    advantage: Literal["mean", "mean_std"] = "mean"
    """Group-relative advantage: "mean" (a completion's reward minus its group's mean) or "mean_std" (that over the
    group's standard deviation)."""
    loss_weighting: Literal["token", "sequence"] = "token"
    """How a group's members weigh in the loss: "token" (each model token the same: long members weigh more) or
    "sequence" (each member the same: advantages scaled by the group's mean length over the member's;
    prl.orchestrator.orchestrator.sequence_weighted)."""
    credit: Literal["trajectory", "turn"] = "trajectory"
    """Multi-turn credit: "trajectory" (every model token gets the trajectory's advantage) or "turn" (each turn's
    tokens: its own outcome against the same turn of the group's other members; `code` scores each attempt, `tools`
    compares a turn only with members that got the same tool results before it;
    prl.orchestrator.orchestrator.turn_advantages)."""
    filter_groups: Literal["none", "uniform"] = "none"
    """Online difficulty filtering (DAPO's dynamic sampling): "uniform" drops a completed group whose rewards are all
    equal (or spread no more than filter_min_std), which carries no learning signal; its prompt counts as consumed and a
    replacement group starts, so batches stay full of groups that teach (prl.orchestrator.buffer.GroupFilter)."""
    filter_min_std: float = Field(0.0, ge=0)
    """With filter_groups = "uniform": a group whose rewards' population standard deviation is at most this is dropped
    (at most, so the default 0 drops exactly the groups of equal rewards)."""
    max_filtered_per_step: int | None = Field(None, ge=0)
    """With filter_groups = "uniform": the most groups dropped while one step's batch is assembled; past it uniform
    groups are trained (counted as groups_uniform), so a task too easy or too hard still trains every step. Unset: a
    step's groups (batch_size / group_size); 0: none dropped, only counted."""

    def filter_bound(self) -> int:
        """Groups filtering may drop per step (`max_filtered_per_step`; 0 when filtering is off)."""
        if self.filter_groups == "none":
            return 0
        return self.batch_size // self.group_size if self.max_filtered_per_step is None else self.max_filtered_per_step

    @model_validator(mode="after")
    def _consistent(self):
        if self.batch_size % self.group_size:
            raise ValueError(
                f"rl.batch_size ({self.batch_size}) must be divisible by rl.group_size ({self.group_size})"
            )
        if self.max_inflight_rollouts < self.group_size:
            raise ValueError(
                f"rl.max_inflight_rollouts ({self.max_inflight_rollouts}) must be >= rl.group_size "
                f"({self.group_size}), or no group can ever start"
            )
        if self.filter_groups == "none" and (self.filter_min_std or self.max_filtered_per_step is not None):
            raise ValueError("rl.filter_min_std and rl.max_filtered_per_step apply to rl.filter_groups = 'uniform': "
                             "set it, or leave them unset")
        return self


class SamplingCfg(Section):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy); the trainer's logprobs use the same temperature (1 when 0)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: only the most likely tokens holding this much probability are sampled (1: all)."""
    max_tokens: int = Field(16, gt=0)
    """Tokens the model samples at most per turn (one turn: the whole completion)."""


HELD_OUT_START = 1_000_000_000  # an eval set of the training task starts here unless eval.<name>.first_index says


class EvalCfg(Section):
    """A held-out evaluation set (`[eval.<name>]`, any number): run on the inference servers during the run (at step
    0, every `every` steps and at the end, never trained on) and by `prl eval` on a checkpoint or a model folder. See
    docs/evaluation.md."""

    task: TaskCfg | None = None
    """The set's task (its examples and reward); unset: the recipe's task, at indices training never reaches
    (`first_index`)."""
    env: EnvCfg | None = None
    """The environment the set runs in; unset: the recipe's `[env]`."""
    data: str | None = None
    """The set's examples from a dataset file (formats and keys as task.data, its rows in file order); the set's task
    is the recipe's (or `eval.<name>.task`) reading this file. The training file itself needs `rows` apart from
    task.rows."""
    rows: list[int] | None = None
    """With data: the rows of the file the set reads, [start, end); unset: every row (or the first `examples`)."""
    examples: int | None = Field(None, gt=0)
    """Examples in the set: indices first_index .. first_index + examples - 1 of the task; for the recipe's own task
    with first_index unset, the first from 1000000000 on whose prompt training cannot draw (the eval's `replaced`
    counts the indices left out). Unset: 32, or every row of a dataset file."""
    first_index: int | None = Field(None, ge=0)
    """The set's first example index; unset: 1000000000 for the recipe's own task (training reaches rl.max_steps x
    (rl.batch_size / rl.group_size + the groups filtering may drop) indices, refused if it could reach this one), 0 for a task of the set's own."""
    samples: int = Field(1, gt=0, le=256)
    """Completions sampled per example (n of pass@k)."""
    pass_k: list[int] = [1]
    """The k of pass@k, best@k and maj@k, each at most `samples`."""
    threshold: float = Field(1.0, ge=0, le=1)
    """A sample is correct (pass@k, maj@k) when its reward is at least this."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature (0: greedy, with samples = 1)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling for the set."""
    max_tokens: int | None = Field(None, gt=0)
    """Tokens sampled at most per turn; unset: sampling.max_tokens."""
    seed: int = Field(0, ge=0)
    """Sampling seed: each request of the set's example k asks for a seed of its own from seed + 2^24 x k on (by
    member and turn; completion j of a request adds j), so a sampled set gives the same samples again on the same
    backend."""
    every: int = Field(10, ge=0)
    """Evaluate the weights after every this many steps (0: only at the start and the end)."""
    at_start: bool = True
    """Evaluate the starting weights (version 0: after the warm start, before RL), the baseline."""
    at_end: bool = True
    """Evaluate the final weights after the last step (the run ends once it is logged)."""
    max_share: float = Field(0.25, gt=0, le=1)
    """The set's samples in flight at most this share of the in-flight rollout budget. They run beside the rollouts,
    not in their budget: training keeps all of it, and the servers' KV usage (rl.kv_usage_target) bounds both."""
    pin_version: bool = False
    """Hold new weights back from the servers while the set runs: every token is sampled by the version it scores
    (`later_share` 0, and `prl eval` gives the same figures), but rollouts wait for newer weights meanwhile, and
    training with them once the set outlasts rl.max_async_level steps. Off: weights load mid-set and `later_share`
    says how much of the set a newer version sampled."""

    @field_validator("rows")
    @classmethod
    def _rows(cls, v: list[int] | None) -> list[int] | None:
        return check_rows(v)

    @field_validator("pass_k")
    @classmethod
    def _ks(cls, v: list[int]) -> list[int]:
        if not v or any(k < 1 for k in v) or len(set(v)) != len(v):
            raise ValueError(f"pass_k = {v}: give distinct k >= 1, e.g. [1, 4]")
        return sorted(v)

    def points(self, max_steps: int) -> list[int]:
        """The steps whose weights (version = step) the set evaluates, ascending."""
        out = {0} if self.at_start else set()
        if self.every:
            out |= set(range(self.every, max_steps, self.every))
        if self.at_end:
            out.add(max_steps)
        return sorted(out)

    def start(self, recipe_task: "TaskCfg") -> int:
        if self.first_index is not None:
            return self.first_index
        return HELD_OUT_START if self.draws_training_data(recipe_task) else 0

    def draws_training_data(self, recipe_task: "TaskCfg") -> bool:
        """Whether the set's examples come from the training task's stream (its own reward aside)."""
        return self.set_task(recipe_task).same_data(recipe_task)

    def set_task(self, recipe_task: "TaskCfg") -> "TaskCfg":
        """The set's task: its own or the recipe's; with `data`, that task reading the set's file. A dataset file's
        rows are read in file order."""
        base = self.task or recipe_task
        if self.data is not None:
            keep = base.model_dump(include={"reward", "prompt_key", "answer_key", "chat_template", "system_prompt",
                                            "max_prompt_tokens"}, exclude_none=True)
            try:
                return TaskCfg.model_validate({**keep, "name": "file", "data": self.data, "rows": self.rows,
                                               "shuffle": False})
            except ValueError as e:
                why = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
                raise ValueError(f"the set's data: {why}") from None
        if base.is_file() and self.task is not None:
            return base.model_copy(update={"shuffle": False})
        return base

    def count(self, rows: int | None) -> int:
        """Examples in the set; `rows`: the rows of its dataset file (None: not a file)."""
        if rows is None:
            return self.examples or 32
        return min(self.examples or rows, rows)


BUILTIN_OBJECTIVES = ("tis", "clip", "mask", "seq_mask", "none", "gspo", "gspo_token", "cispo")


class LossCfg(Section):
    """The RL objective: how the trainer's logprobs, the sampling policy's and the advantages make the loss (see
    docs/objectives.md)."""

    correction: str = "clip"
    """The objective: "clip" (PPO's clip against the policy that sampled each token, its ratio capped at tis_cap),
    "tis" (weighted by the ratio capped at tis_cap), "cispo" (weighted by the ratio clipped to [1 - cispo_clip_low,
    1 + cispo_clip_high], gradient stopped: every token keeps its gradient), "gspo" (GSPO: one ratio per sample, the
    geometric mean of its tokens', clipped in [1 - gspo_clip_low, 1 + gspo_clip_high]), "gspo_token" (GSPO-token: the
    sample's ratio, each token's own advantage), "mask" (tokens outside [mask_low, mask_high] get no gradient),
    "seq_mask" (whole samples masked by their geometric-mean ratio), "none", or your own as "module:function"
    (docs/objectives.md gives its signature)."""
    tis_cap: float = Field(2.0, gt=0)
    """With correction "tis" or "clip": the importance ratio is capped here."""
    mask_low: float = Field(0.5, gt=0)
    """With correction "mask" or "seq_mask": the lowest ratio trained."""
    mask_high: float = Field(2.0, gt=0)
    """With correction "mask" or "seq_mask": the highest ratio trained."""
    clip_low: float = Field(0.2, gt=0, lt=1)
    """With correction "clip": a token with a negative advantage whose ratio is below 1 - clip_low gets no gradient
    (PPO's clip on the ratio to the sampling policy)."""
    clip_high: float = Field(0.2, gt=0)
    """With correction "clip": a token with a positive advantage whose ratio is above 1 + clip_high gets no gradient."""
    gspo_clip_low: float = Field(3e-4, gt=0, lt=1)
    """With correction "gspo" or "gspo_token": a sample with a negative advantage whose sequence ratio is below 1 -
    gspo_clip_low gets no gradient (GSPO's range is about a thousandth of PPO's: its ratio is a per-token mean)."""
    gspo_clip_high: float = Field(4e-4, gt=0)
    """With correction "gspo" or "gspo_token": a sample with a positive advantage whose sequence ratio is above 1 +
    gspo_clip_high gets no gradient."""
    cispo_clip_low: float = Field(1.0, gt=0, le=1)
    """With correction "cispo": the weight is at least 1 - cispo_clip_low (1: no lower bound, as MiniMax-M1)."""
    cispo_clip_high: float = Field(1.0, gt=0)
    """With correction "cispo": the weight is at most 1 + cispo_clip_high (1: capped at 2, the same as "tis" at
    tis_cap = 2)."""
    normalize: Literal["auto", "token", "sequence", "constant"] = "auto"
    """What the step's summed loss is divided by: "token" (the step's loss tokens, as DAPO), "sequence" (each
    sample's loss is its tokens' mean, then the mean over the step's samples), "constant" (Dr. GRPO: rl.batch_size x
    the longest completion, sampling.max_tokens, or env.max_total_tokens with turns), "auto" ("sequence" for "gspo",
    and "gspo_token", as their paper; "token" otherwise). The trainer divides."""
    kl_coef: float = Field(0.0, ge=0)
    """Adds kl_coef x a KL estimate to a frozen reference policy (the weights RL starts from, after the warm start)
    on every loss token; 0: no reference is kept. The reference is sharded like the policy and costs one more
    forward per micro-batch and its weights' memory (`prl plan` counts it)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The KL estimator, with r = log pi_ref - log pi: "k1" (-r), "k2" (r^2 / 2), "k3" (exp(r) - r - 1: unbiased,
    never negative)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Adds -entropy_coef x the policy's mean token entropy to the loss (an entropy bonus; 0: entropy is logged, not
    trained)."""

    @field_validator("correction")
    @classmethod
    def _objective(cls, v: str) -> str:
        if v in BUILTIN_OBJECTIVES:
            return v
        if not re.fullmatch(CALLABLE, v):
            raise ValueError(f"trainer.loss.correction = {v!r}: one of {', '.join(BUILTIN_OBJECTIVES)}, or your own "
                             f"objective as 'module:function'")
        return v

    @model_validator(mode="after")
    def _band(self):
        if self.mask_low >= self.mask_high:
            raise ValueError(f"trainer.loss.mask_low ({self.mask_low}) must be < mask_high ({self.mask_high})")
        return self

    def normalization(self) -> str:
        """`normalize` with "auto" resolved."""
        if self.normalize != "auto":
            return self.normalize
        return "sequence" if self.correction in ("gspo", "gspo_token") else "token"

    def whole_samples(self) -> bool:
        """Whether the normalisation needs every token of a sample on one rank (no context parallelism). An
        objective that reads its sample's mean declares it next to its function (`prl.trainer.loss.builtin`),
        and the launch's preflight checks it."""
        return self.normalization() == "sequence"


class ParallelCfg(Section):
    """How the trainer's ranks (trainer.nproc per trainer host) are arranged, as in torchtitan:
    `dp_shard` x `cp` = world; expert parallelism borrows `ep` of those ranks for the experts
    (experts are split over `ep` ranks, tokens travel to them by all-to-all)."""

    dp_shard: int = Field(-1, ge=-1)
    """Data-parallel ranks the weights are sharded over (FSDP2); -1: world / cp."""
    cp: int = Field(1, ge=1)
    """Context parallelism: ranks each sample's tokens are split over (GLM-5's DSA attention only)."""
    cp_layout: str = "zigzag"
    """With cp > 1, which tokens each rank holds: "zigzag" (chunk c and its mirror 2cp-1-c of 2cp chunks: causal
    attention costs every rank the same) or "contiguous" (slice c: the last rank costs ~2cp/(cp+1)x the mean)."""
    ep: int = Field(1, ge=1)
    """Expert parallelism: ranks the routed experts are split over, tokens travelling to them by all-to-all; must
    divide the world and the experts."""
    ep_dispatch: Literal["plain", "fp8"] = "plain"
    """The experts' all-to-all (prl/trainer/ep_dispatch.py): "fp8" sends what goes toward the experts as block FP8
    (1x128 tiles, fp32 scales alongside), dequantised on arrival; "plain": in trainer.dtype. The way back to the
    tokens stays in trainer.dtype either way."""
    ep_node_dedup: bool = False
    """A token goes once to each node holding any of its experts, then to each rank there that holds one."""
    ep_ranks_per_node: int = Field(0, ge=0)
    """Ep ranks per node for the dedup (consecutive ranks share a node); 0: trainer.nproc, the ranks of one trainer
    host. Set it to simulate nodes on one machine (4 ranks as 2 nodes of 2: ep_ranks_per_node = 2)."""
    overlap: bool | Literal["chunks", "two_batch"] = "chunks"
    """Hide exchanges behind compute (prl/trainer/overlap.py). true or "chunks": each MoE layer's tokens go through
    the experts in `overlap_chunks` chunks, one chunk's all-to-all in flight while another's experts run (forward and
    backward), and context parallelism's gather flies while the attention computes its queries (with ep_node_dedup,
    two chunks at a time through both hops). "two_batch" (needs ep > 1 and the lean forward): each MoE layer runs
    its micro-batch as two halves (`overlap_parts`), one half's attention, router and shared experts computing while
    the other's rows travel (prl/trainer/two_batch.py). false: each exchange waited for as soon as it is issued.
    Same values every way (to fp32 rounding)."""
    overlap_chunks: int = Field(4, ge=2, le=64)
    """With overlap = true or "chunks": token chunks per MoE layer; more hide more of the first dispatch and the last
    combine, each costs one more exchange per layer and direction."""
    overlap_parts: int = Field(2, ge=2, le=16)
    """With overlap = "two_batch": the parts each micro-batch runs as (2: two-batch overlap); more hide more of each
    layer's first dispatch and last combine (bench/comm_overlap.py), each costs one more exchange per layer and
    direction."""

    @field_validator("overlap", mode="before")
    @classmethod
    def _overlap(cls, v):
        if isinstance(v, str) and v not in ("chunks", "two_batch"):
            raise ValueError(f"trainer.parallel.overlap = {v!r}: one of true (\"chunks\"), \"two_batch\" or false")
        return "chunks" if v is True else v

    @model_validator(mode="after")
    def _positive(self):
        if self.overlap == "two_batch" and self.ep == 1:
            raise ValueError("trainer.parallel.overlap = 'two_batch' hides the experts' all-to-all, and ep = 1 has "
                             "none: set trainer.parallel.ep > 1, or overlap = true")
        if self.dp_shard == 0:
            raise ValueError("trainer.parallel.dp_shard must be >= 1, or -1 for world / cp")
        for key, on in (("ep_dispatch = 'fp8'", self.ep_dispatch == "fp8"), ("ep_node_dedup", self.ep_node_dedup)):
            if on and self.ep == 1:
                raise ValueError(f"trainer.parallel.{key} shapes the experts' all-to-all, and ep = 1 has none: "
                                 f"set trainer.parallel.ep > 1 or leave it out")
        if self.cp_layout not in ("zigzag", "contiguous"):
            raise ValueError(f"trainer.parallel.cp_layout = {self.cp_layout!r}: expected \"zigzag\" (each rank holds a "
                             f"chunk from the start of the row and its mirror from the end; the default) or "
                             f"\"contiguous\" (rank c holds slice c)")
        return self

    def dims(self, world: int) -> ParallelDims:
        """The trainer's layout at `world` ranks (checked), which owns the rank arithmetic and meshes."""
        self.check(world, None)
        return ParallelDims.of(world, self.dp_shard, self.cp, self.ep)

    def data_parallel(self, world: int) -> int:
        """Ranks that each take their own micro-batches (the orchestrator packs for these)."""
        return self.dims(world).dp_size

    def check(self, world: int, num_experts: int | None, per_host: int | None = None) -> None:
        """Against the trainer's world size, the model (None: a pretrained folder, checked at load) and
        the ranks per trainer host (None: not known here)."""
        if self.dp_shard == -1 and world % self.cp:
            raise ValueError(f"trainer.parallel.cp ({self.cp}) must divide the trainer's world size ({world} = "
                             f"trainer.nproc x trainer hosts)")
        dp = ParallelDims.of(world, self.dp_shard, self.cp, self.ep).dp_shard
        if dp * self.cp != world:
            raise ValueError(f"trainer.parallel: dp_shard ({dp}) x cp ({self.cp}) must equal the trainer's world "
                             f"size ({world} = trainer.nproc x trainer hosts)")
        if world % self.ep:
            raise ValueError(f"trainer.parallel.ep ({self.ep}) must divide the trainer's world size ({world})")
        if num_experts is not None and num_experts % self.ep:
            raise ValueError(f"trainer.parallel.ep ({self.ep}) must divide the model's experts ({num_experts})")
        if self.ep_ranks_per_node or (self.ep_node_dedup and per_host):
            self.ranks_per_node(world, per_host or world)

    def ranks_per_node(self, world: int, per_host: int) -> int:
        """Trainer ranks on one node: `ep_ranks_per_node`, else `per_host` (the ranks of one trainer host).
        With ep_node_dedup an ep group (consecutive ranks) must be whole nodes, or lie inside one."""
        per = self.ep_ranks_per_node or per_host
        what = f"trainer.parallel.ep_ranks_per_node ({per})" if self.ep_ranks_per_node else \
            f"the trainer ranks of one host ({per}, trainer.nproc)"
        if world % per:
            raise ValueError(f"{what} must divide the trainer's world size ({world}): a node holds whole ranks")
        if self.ep_node_dedup and self.ep % per and per % self.ep:
            raise ValueError(f"trainer.parallel.ep_node_dedup: ep ({self.ep}) must be a multiple of {what}, or "
                             f"divide it (an expert group spans whole nodes or lies inside one)")
        return per


LORA_GROUPS = ("attention", "mlp", "shared_experts", "routed_experts")


class LoraCfg(Section):
    """LoRA RL: low-rank adapters trained on a frozen base, and only the adapters published each step (see
    docs/lora.md). The warm start (`[sft]`) still trains every weight; the adapters start after it."""

    rank: int = Field(0, ge=0)
    """Adapter rank; 0: LoRA off (every weight trained, the default). Rank 1 to 64 is usual for RL."""
    alpha: float = Field(32.0, gt=0)
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (0: none)."""
    targets: list[str] = ["attention", "mlp", "shared_experts"]
    """Module groups that get adapters, named per model family: "attention" (the attention projections; MLA's
    kv_b_proj and the DSA indexer stay frozen), "mlp" (dense MLP layers), "shared_experts", "routed_experts" (opt-in:
    per-expert adapters on the stacked experts; built for the embedded engine at trainer.parallel.ep = 1 without
    trainer.fp8)."""

    @field_validator("targets")
    @classmethod
    def _groups(cls, v: list[str]) -> list[str]:
        bad = [g for g in v if g not in LORA_GROUPS]
        if bad or not v or len(set(v)) != len(v):
            raise ValueError(f"trainer.lora.targets = {v}: a non-empty list of distinct groups from "
                             f"{', '.join(LORA_GROUPS)}")
        return v

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def manifest(self) -> dict:
        """What a LoRA checkpoint's manifest says of its adapters (its base: the step-0 checkpoint)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "base": "step_0"}


class TrainerCfg(Section):
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate of the RL steps (AdamW)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up to the peak learning rate (0: none); the warm start uses it too."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after the warm-up: "constant", or "cosine" down to lr x min_lr_ratio at rl.max_steps."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """With schedule "cosine": the last learning rate as a fraction of lr."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay (0: none)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm before each optimizer step."""
    nproc: int = Field(1, gt=0)
    """Trainer ranks (processes, one per GPU) per trainer host; the world is nproc x trainer hosts."""
    micro_batch_tokens: int = Field(4096, gt=0)
    """Tokens in one packed row of a micro-batch (one forward and backward); must hold a whole sample."""
    checkpoint_every: int = Field(10, ge=0)
    """Steps between checkpoints (0: only at the end)."""
    keep_weights: int = Field(3, ge=2)
    """Published weight versions kept in RUN_DIR/weights and on hosts that download them; older ones are deleted."""
    weight_transfer: Literal["folder", "collective", "stream"] = "folder"
    """How a new version reaches the servers: "folder" (sealed folder, read in place or downloaded); "collective" (also
    streamed from rank 0 straight into the servers' memory, gloo or NCCL, the folder kept as the fallback;
    `prl.transport.collective`); "stream": as "collective", every rank streaming its share of the buckets, each
    expert's tensors only to the receivers serving it."""
    weight_transfer_timeout_s: float = Field(120.0, gt=0)
    """Seconds: a stalled weight broadcast fails after this."""
    publish_overlap: bool = True
    """A new version is published while the next step computes: each rank copies its shards of the weights into
    host memory (a frozen copy the next optimizer step cannot change) and a thread of its own gathers, converts and
    sends them (folder, collective or stream) over a process group of its own; versions go one at a time, in order,
    and a trainer killed mid-publish leaves the last sealed version serving. false: the step waits for the publish."""
    checkpoint_format: Literal["auto", "sharded", "full"] = "auto"
    """How checkpoints are written: "sharded" (every rank its own shards, torch.distributed.checkpoint, no gather),
    "full" (rank 0 gathers the whole state) or "auto" (sharded when the trainer runs on one host)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; "auto": nccl when CUDA is available, else gloo."""
    threads: int = Field(1, gt=0)
    """CPU threads of each trainer rank (torch.set_num_threads and OMP_NUM_THREADS)."""
    router_replay: bool = False
    """R3: replay the experts the inference engine chose."""
    fp8: bool = False
    """Block-scaled FP8 for eligible attention/MLP linears and experts."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype; weights, gradient reduction and optimizer state stay fp32 (FSDP2 mixed precision)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward."""
    lean_forward: bool = True
    """The trainer's forward through the model's own modules without transformers' per-call machinery
    (`prl.trainer.lean`; the same values and gradients), context parallelism included (its attention builds its own
    masks); where it does not apply (a family without one, sliding windows) the model's forward runs."""
    logprob_chunk_tokens: int = Field(1024, ge=0)
    """Logprobs computed per this many tokens, so the whole logits never exist at once (0: all at once)."""
    share_prompts: bool | None = None
    """A group's members trained over one copy of their prompt (`prl.transport.trees`); unset: on unless context
    parallelism splits the rows (its attention does not take the trees' mask)."""
    parallel: ParallelCfg = ParallelCfg()
    """How the trainer's ranks are arranged."""
    loss: LossCfg = LossCfg()
    """The RL loss's off-policy correction."""
    lora: LoraCfg = LoraCfg()
    """LoRA RL (rank 0: off)."""

    @model_validator(mode="after")
    def _whole_rows(self):
        """What needs each rank to hold whole samples: not context parallelism. Two-batch overlap: the lean forward."""
        if self.parallel.overlap == "two_batch" and not self.lean_forward:
            raise ValueError("trainer.parallel.overlap = 'two_batch' runs through the lean forward: leave "
                             "trainer.lean_forward on, or set overlap = true")
        if self.share_prompts and self.parallel.cp > 1:
            raise ValueError("trainer.share_prompts = true needs trainer.parallel.cp = 1: context parallelism "
                             "splits rows its own way and does not take the shared prompts' attention mask")
        if self.loss.whole_samples() and self.parallel.cp > 1:
            raise ValueError(f"trainer.loss.normalize = {self.loss.normalize!r} (\"sequence\" with trainer.loss.correction "
                             f"= {self.loss.correction!r}) needs trainer.parallel.cp = 1: a rank holds part of a sample "
                             f"there, and sequence normalisation divides by the whole sample's loss tokens")
        return self

    @property
    def shares_prompts(self) -> bool:
        return self.share_prompts is not False and self.parallel.cp == 1


class KvPoolCfg(Section):
    """A prompt-KV pool over the run's inference servers (Mooncake): a `kv-master` process plus
    `memory_gb` of every server's memory; a server loads pooled prompt chunks instead of computing."""

    enabled: bool = False
    """Run the pool: a kv-master process, and memory_gb of every server's memory."""
    host: str | None = None
    """Cluster: the host (by name) running mooncake_master; default: the first inference host."""
    port: int = Field(0, ge=0, le=65533)
    """The master's rpc port; +1 metadata, +2 metrics (0: free ports, 50051 on a cluster)."""
    memory_gb: float = Field(1.0, gt=0)
    """GB of memory each server contributes to the pool."""
    chunk_tokens: int = Field(256, gt=0)
    """Prompt KV is pooled per chunk of this many tokens."""
    retry_s: float = Field(30.0, gt=0)
    """Seconds: after a store error a server computes everything this long, then retries."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Mooncake's transport between pool members: "tcp"; "rdma" is taken by `prl plan` and --dry-run but refused by
    `prl run` (not built)."""
    disk_path: str | None = None
    """The disk tier: an absolute folder every pool member sees; unset: memory only."""
    disk_gb: float = Field(0, ge=0)
    """GB of the disk tier (0: the filesystem's size)."""

    @field_validator("disk_path")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute path (the master and every server resolve it on their own host)")
        return v


class InferenceCfg(Section):
    backend: str = "embedded"
    """The inference engine, a name in prl.backends.registry: "embedded" (prl's own) or "vllm"."""
    num_servers: int = Field(1, gt=0)
    """Inference servers on this machine (a cluster: from [placement] instead)."""
    host: str = "127.0.0.1"
    """The address the run's processes bind on this machine (a cluster: each host's address)."""
    port: int = Field(0, ge=0, le=65535)
    """First server port on this machine, the next servers on the ports after it (0: free ports picked at launch)."""
    max_batch_size: int = Field(64, gt=0)
    """Sequences a server decodes at once (vLLM's --max-num-seqs: per attention replica)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the servers' weights."""
    fp8: bool = False
    """The engine computes with the same block-scaled FP8 weights."""
    threads: int = Field(1, gt=0)
    """CPU threads of each server process (torch.set_num_threads and OMP_NUM_THREADS)."""
    prefix_cache_entries: int = Field(256, ge=0)
    """Embedded engine: finished prompts and sequences whose KV is kept for a later prompt sharing their prefix, least
    recently used evicted (0: no prefix cache)."""
    kv_capacity_tokens: int = Field(0, ge=0)
    """Embedded engine: KV token slots of the running batch (0: unbounded)."""
    prefill_wait_steps: int = Field(3, ge=0)
    """Embedded engine: while a batch decodes, a request whose prompt is computed whole waits up to this many decode
    steps for others to share its prefill forward (0: each joins at once)."""
    compile: bool = False
    """Embedded engine: every forward through torch.compile (CPU: about 1.5x the tokens/s on the tiny Qwen3-MoE; the
    server compiles for a minute or so before it answers /health)."""
    startup_timeout_s: int = Field(600, gt=0)
    """Seconds a server has to answer /health after it starts."""
    vllm: dict[str, Any] = {}
    """backend = "vllm": any other vLLM argument, e.g. max_num_batched_tokens = 512 (arguments prl sets itself are
    refused)."""
    kv_pool: KvPoolCfg = KvPoolCfg()
    """A prompt-KV pool shared by the run's servers (Mooncake)."""
    prefill_servers: int = Field(0, ge=0)
    """P/D: the first N servers (placement order) only prefill into the KV pool."""
    hosts_per_engine: int = Field(1, gt=0)
    """Serving layout (vLLM; `prl plan` compares layouts): hosts one engine spans, placement.gpus_per_server GPUs on
    each. Default: one tensor-parallel server per gpus_per_server GPUs."""
    data_parallel_size: int = Field(1, gt=0)
    """Attention replicas of one engine, each with its own sequences and KV and tensor parallel over its share of the
    GPUs."""
    data_parallel_local: int = Field(0, ge=0)
    """Attention replicas of an engine on each of its hosts, each tensor parallel over gpus_per_server /
    data_parallel_local GPUs (0: data_parallel_size / hosts_per_engine)."""
    expert_parallel: bool = False
    """Shard the routed experts over all the engine's GPUs."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """fp8: MLA latent and DSA indexer keys stored in FP8."""
    mtp_tokens: int = Field(0, ge=0)
    """Draft tokens per decode step from the model's MTP layer (speculative decoding)."""
    redundant_experts: int = Field(0, ge=0)
    """vLLM's EPLB: this many extra expert slots, so that an engine's GPUs divide the experts (with expert_parallel,
    ignored without it, so a layout without EP can be tried with --set); 0: none."""

    def local_replicas(self) -> int:
        """Attention replicas of one engine on one host."""
        return self.data_parallel_local or self.data_parallel_size // self.hosts_per_engine

    @model_validator(mode="after")
    def _layout(self):
        if self.data_parallel_size % self.hosts_per_engine:
            raise ValueError(f"inference.data_parallel_size ({self.data_parallel_size}) must be a multiple of "
                             f"inference.hosts_per_engine ({self.hosts_per_engine}): every host of an engine runs "
                             f"the same number of attention replicas")
        if self.data_parallel_local and self.data_parallel_local * self.hosts_per_engine != self.data_parallel_size:
            raise ValueError(f"inference.data_parallel_local ({self.data_parallel_local}) x hosts_per_engine "
                             f"({self.hosts_per_engine}) must equal inference.data_parallel_size "
                             f"({self.data_parallel_size}); or leave data_parallel_local at 0")
        return self

    @model_validator(mode="after")
    def _backend_options(self):
        """What needs no backend spec (the backend's name, arguments and layouts are checked at launch:
        `prl.launch.checks`)."""
        if self.compile and self.backend != "embedded":
            raise ValueError(f"inference.compile: compiles the embedded engine's forwards; the {self.backend!r} "
                             f"backend compiles by its own options (inference.{self.backend})")
        if self.prefill_servers and not self.kv_pool.enabled:
            raise ValueError("inference.prefill_servers: prefill servers hand prompts to decode servers through the "
                             "KV pool; set inference.kv_pool.enabled = true")
        return self


LAYOUT_KEYS = ("hosts_per_engine", "data_parallel_size", "data_parallel_local", "expert_parallel", "kv_cache_dtype",
               "mtp_tokens", "redundant_experts")


class HostCfg(Section):
    """One bare-metal host reached over SSH (key files only; passwords are never used)."""

    address: str
    """How the workstation and the other hosts reach it; its processes bind to it."""
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+$")
    """The host's name in [placement] (letters, digits, `.`, `_`, `-`); default: its address."""
    user: str = "root"
    """SSH user."""
    port: int = Field(22, gt=0, le=65535)
    """SSH port."""
    key_file: str | None = None
    """SSH private key file (~ expanded); unset: the SSH agent and the default keys, as `ssh` does."""
    gpus: int = Field(0, ge=0)
    """GPUs the recipe expects `nvidia-smi` to list (0: a CPU host)."""
    workdir: str | None = None
    """Overrides cluster.workdir on this host."""

    @property
    def id(self) -> str:
        return self.name or self.address


class ClusterCfg(Section):
    """Hosts for a multi-host run. Without this section a recipe runs on the local machine."""

    hosts: list[HostCfg] = Field(min_length=1)
    """The hosts, one [[cluster.hosts]] table each."""
    workdir: str = "/tmp/prl"
    """On every host: runs/NAME (the run's files) and venvs/HASH."""
    python: str = "python3"
    """The interpreter whose packages (torch, CUDA) the run's venv builds on."""
    extras: list[str] = []
    """Extras of this project to install on the hosts (e.g. ["vllm"])."""
    venv: str | None = None
    """An environment to use (created if missing); default: one per wheel in workdir/venvs."""
    min_python: str = "3.11"
    """The oldest Python version cluster.python may be (`prl doctor` checks every host)."""
    min_free_gb: float = Field(1.0, ge=0)
    """GB that must be free in each host's workdir (`prl doctor` checks every host)."""
    known_hosts: str | None = None
    """The known_hosts file the hosts' SSH keys are checked against; default: ~/.ssh/known_hosts."""
    trust_unknown_hosts: bool = False
    """Accept a host whose SSH key known_hosts lacks instead of refusing it."""
    rendezvous_port: int = Field(29500, gt=0, le=65535)
    """Port of torchrun's rendezvous, on the first trainer host."""
    trainer_port: int = Field(29600, gt=0, le=65535)
    """Port of the trainer endpoint (rollouts in, weights out), on rank 0."""
    inference_port: int = Field(8000, gt=0, le=65535)
    """The first server port on each inference host, the next servers on the ports after it."""
    sandbox_port: int = Field(8900, gt=0, le=65535)
    """Port of the sandbox worker on each sandbox host."""
    engine_rpc_port: int = Field(13345, gt=0, le=65535)
    """Port of a multi-host engine's data-parallel RPC, on its leader."""
    weight_transfer: Literal["http", "nccl"] = "http"
    """How weights reach the servers: "nccl" sets trainer.weight_transfer = "stream" (every trainer rank streams its
    share; NCCL where every member holds a GPU, gloo otherwise); "http": the trainer's own setting."""
    heartbeat_timeout_s: int = Field(60, ge=10)
    """Seconds: remote processes stop when the driver is silent this long."""
    env: dict[str, str] = {}
    """Extra environment for every process on the hosts (e.g. NCCL_SOCKET_IFNAME)."""
    shared_checkpoints: str | None = None
    """A folder every trainer host mounts at this path (NFS, Lustre): checkpoints of a trainer spanning several hosts
    go to SHARED/RUN_NAME, written sharded by every rank (run_dir/checkpoints links there)."""

    def workdir_of(self, h: HostCfg) -> str:
        return h.workdir or self.workdir

    def hosts_by_id(self) -> dict[str, HostCfg]:
        return {h.id: h for h in self.hosts}


class PlacementCfg(Section):
    """Which hosts (by name) run what. Default: trainer on the first host, inference on the others."""

    trainer: list[str] = Field(min_length=1)
    """Hosts running the trainer, trainer.nproc ranks each (the first: rank 0 and the rendezvous)."""
    inference: list[str] = Field(min_length=1)
    """Hosts running the inference servers."""
    gpus_per_server: int = Field(1, gt=0)
    """On GPU hosts: servers per host = gpus // gpus_per_server."""
    orchestrator: str | None = None
    """A host name or "workstation"; default: the first trainer host."""
    sandbox: list[str] | None = None
    """env.kind = "code": hosts of the sandbox workers (default: the inference hosts)."""

    def servers_on(self, h: "HostCfg") -> int:
        """Inference servers on host `h`: one per `gpus_per_server` GPUs, one on a CPU host."""
        return max(1, h.gpus // self.gpus_per_server)


# bench/comm_overlap.py at the flagship's exchanges / compute (0.82): per trainer.parallel.overlap mode, the lower
# of its two layouts (docs/benchmarks.md)
OVERLAP_EFFICIENCY = {"chunks": 0.66, "two_batch": 0.66, "two_batch_4": 0.73}


def measured_overlap(overlap: str, parts: int) -> float:
    """The bench's efficiency for an overlap mode: the chunk pipeline, or two-batch overlap in 2-3 parts or 4+."""
    if overlap != "two_batch":
        return OVERLAP_EFFICIENCY["chunks"]
    return OVERLAP_EFFICIENCY["two_batch_4" if parts >= 4 else "two_batch"]


class PlanCfg(Section):
    """The assumptions of `prl plan` (defaults: H200 GPUs, 400 Gb/s per GPU between hosts)."""

    gpu_memory_gb: float = Field(141.0, gt=0)
    """Memory of one GPU, in GB."""
    memory_headroom: float = Field(0.9, gt=0, le=1)
    """Usable fraction of it (allocator, CUDA context, NCCL buffers)."""
    gpu_tflops: float = Field(989.0, gt=0)
    """Dense bf16 peak per GPU, in TFLOP/s."""
    fp8_tflops: float = Field(1979.0, gt=0)
    """Dense FP8 peak per GPU, in TFLOP/s (FP8 GEMMs: trainer.fp8, inference.fp8)."""
    mfu: float = Field(0.35, gt=0, le=1)
    """Fraction of peak the trainer, prefill and decode compute reach."""
    hbm_tb_s: float = Field(4.8, gt=0)
    """Memory (HBM) bandwidth of one GPU, in TB/s."""
    decode_efficiency: float = Field(0.5, gt=0, le=1)
    """Fraction of HBM bandwidth decode reaches."""
    nvlink_gb_s: float = Field(450.0, gt=0)
    """GB/s per GPU, one direction, inside a host."""
    network_gb_s: float = Field(50.0, gt=0)
    """GB/s per GPU between hosts."""
    collective_latency_us: float = Field(25.0, ge=0)
    """Microseconds: fixed cost of one all-to-all or all-reduce while decoding."""
    prompt_tokens: int = Field(0, ge=0)
    """Mean prompt length in tokens (0: the task's longest prompt)."""
    completion_fraction: float = Field(0.5, gt=0, le=1)
    """Mean model tokens over the budget (sampling.max_tokens)."""
    p99_tokens: int = Field(0, ge=0)
    """p99 trajectory length in tokens (0: the longest sample the recipe allows)."""
    turns: float = Field(0, ge=0)
    """Mean turns per trajectory (0: 1 single-turn, else env.max_turns)."""
    env_tokens_per_turn: int = Field(0, ge=0)
    """Environment tokens after each model turn but the last (0: env.max_env_chars / 4)."""
    env_seconds_per_turn: float = Field(2.0, ge=0)
    """Seconds of a tool call or sandbox run, per turn but the last."""
    mtp_acceptance: float = Field(0.7, ge=0, le=1)
    """Chance a draft token is accepted (inference.mtp_tokens)."""
    expert_imbalance: float = Field(1.2, ge=1)
    """The busiest EP rank's routed tokens over the mean."""
    cuda_graphs_gb: float = Field(2.0, ge=0)
    """GB per GPU of vLLM's captured decode graphs."""
    indexer_block: int = Field(4096, gt=0)
    """DSA indexer scores computed per this many queries."""
    fp8_dispatch: bool = False
    """Count FP8 expert dispatch in the trainer (trainer.parallel.ep_dispatch = "fp8"; built, its speed needs GPUs)."""
    node_dedup: bool = False
    """Count node-level deduplication of the trainer's dispatch (trainer.parallel.ep_node_dedup; built, its speed needs
    GPUs)."""
    overlap_efficiency: float | None = Field(None, ge=0, le=1)
    """With trainer.parallel.overlap: the share of min(compute, exchanges) hidden, the exchanges being the expert
    all-to-all and CP's gathers (FSDP's gathers and the weight send are counted whole). Unset: bench/comm_overlap.py's
    figure for the recipe's overlap mode at the flagship's ratio, the lower of its two layouts, measured over shaped
    links on CPUs (docs/benchmarks.md): 0.66 for the chunk pipeline and two-batch overlap in halves, 0.73 in 4 parts."""

    @model_validator(mode="before")
    @classmethod
    def _gone(cls, data):
        if isinstance(data, dict) and "overlap_comm" in data:
            raise ValueError("plan.overlap_comm is gone: prl plan counts overlap where trainer.parallel.overlap is on "
                             "(the default) with the measured plan.overlap_efficiency; remove the key")
        return data


class TeacherCfg(Section):
    """On-policy distillation: a frozen model the run serves scores every token the student samples (one forward per
    trajectory, nothing generated), and each model token's advantage gains kl_coef * (log p_teacher - log p_student),
    the per-token reverse KL's negative, beside reward_weight times the task's group advantage."""

    path: str = Field(min_length=1)
    """The teacher: a Hugging Face model folder on this machine (e.g. a `prl ckpt export` of a trained run), with the
    student's tokenizer."""
    servers: int = Field(1, gt=0)
    """Inference servers of the teacher (the recipe's inference.backend and [inference] settings; its weights never
    change)."""
    kl_coef: float = Field(1.0, ge=0)
    """Weight of the per-token reverse-KL advantage, log p_teacher - log p_student of each sampled token."""
    reward_weight: float = Field(0.0, ge=0)
    """Weight of the task reward's group advantage beside it (0: distillation alone)."""
    mode: Literal["advantage", "loss"] = "advantage"
    """How the teacher's logprobs teach: "advantage", each model token's advantage gains kl_coef * (log p_teacher -
    log p_student); "loss", the trainer adds kl_coef times a KL estimate to the teacher on each sampled token to the
    loss (kl_estimator), as it adds the KL to a reference."""
    kl_estimator: Literal["k2", "k3"] = "k2"
    """With mode = "loss", the per-token estimate, r = log p_teacher - log p_student: "k2" (r^2 / 2), whose gradient
    over the student's samples is the reverse KL's, KL(student || teacher), as advantage mode follows; "k3"
    (exp(r) - r - 1), whose gradient is the forward KL's, KL(teacher || student)."""

    @model_validator(mode="after")
    def _some_signal(self):
        if self.kl_coef == 0 and self.reward_weight == 0:
            raise ValueError("teacher.kl_coef and teacher.reward_weight are both 0: nothing to learn from")
        return self


class RewardModelCfg(Section):
    """A reward model the run serves: a Hugging Face sequence-classification folder (one label) that scores each
    sampled conversation, prompt and completion, with its own tokenizer and chat template."""

    path: str = Field(min_length=1)
    """The reward model: a Hugging Face folder on this machine whose architecture ends in ForSequenceClassification
    (e.g. Qwen3ForSequenceClassification) and that has one label."""
    servers: int = Field(1, gt=0)
    """Reward-model servers (`reward-model-N`, started, health-checked and restarted with the run)."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """What the score counts in each sample's reward: reward.task_weight * task reward + weight * score."""
    normalize: Literal["none", "group"] = "none"
    """"group": each score minus its group's mean, over the group's standard deviation (a group whose scores are
    equal gives 0), before the weight; "none": the score as the model gives it."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the reward model's weights."""
    threads: int = Field(1, gt=0)
    """CPU threads of each reward-model server."""
    max_tokens: int = Field(4096, gt=0)
    """The longest conversation scored, in the reward model's tokens; a longer one is cut from the left (the
    prompt's start first)."""


JUDGE_TEMPLATE = ("Rate how well the answer solves the task, from 0 (wrong) to 10 (right).\n\nTask: {prompt}\n\n"
                  "Reference answer: {answer}\n\nAnswer: {completion}\n\nEnd with 'Score: N'.")
JUDGE_FIELDS = {"prompt", "completion", "answer"}


class JudgeCfg(Section):
    """An LLM judge: a model asked, for each sampled completion, to rate it with a rubric; its answer is parsed to a
    score. Either served by the run (`path`) or an OpenAI-compatible server elsewhere (`base_url`)."""

    path: str | None = Field(None, min_length=1)
    """A Hugging Face model folder here that the run serves as the judge (`judge-N` servers, embedded engine, its
    weights never change)."""
    base_url: str | None = Field(None, pattern=r"^https?://[^\s@/]+(/\S*)?$")
    """An OpenAI-compatible server's base URL, e.g. "http://10.0.0.5:8000/v1" (its /chat/completions is asked)."""
    model: str = Field("judge", min_length=1)
    """The model name sent with each request (a served judge answers whatever it is)."""
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """With base_url: the environment variable holding the server's API key (read by the orchestrator; never
    written to the run's files or logs). Unset: no key is sent."""
    servers: int = Field(1, gt=0)
    """With path: the judge's servers."""
    template: str = JUDGE_TEMPLATE
    """The judge's prompt, with {prompt}, {completion} and {answer} (the example's "answer", empty without one);
    sent as one user message."""
    score_regex: str = r"(?i)score[^\w-]*(-?\d+(?:\.\d+)?)"
    """The score: the first group of this regular expression's last match in the judge's answer, as a number."""
    parser: str | None = Field(None, pattern=rf"^{CALLABLE}$")
    """Instead of score_regex: a function as "module:function" ((judge's answer, example) -> a float, or None when
    the answer gives no score)."""
    temperature: float = Field(0.0, ge=0, le=100)
    """The judge's sampling temperature."""
    max_tokens: int = Field(64, gt=0)
    """The longest judge answer."""
    concurrency: int = Field(16, gt=0)
    """Judge requests in flight at once."""
    timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """An outside judge's request unanswered this long is sent again; after three such times, or on its failures,
    the group is dropped and counted. A judge the run serves is reported hung past run.hang_timeout_s, as the run's
    other servers are."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """What the judge's score counts in each sample's reward (a 0-10 rubric: 0.1 puts it in [0, 1])."""
    normalize: Literal["none", "group"] = "none"
    """As reward.model.normalize, for the judge's scores."""

    @model_validator(mode="after")
    def _one_judge(self):
        if (self.path is None) == (self.base_url is None):
            raise ValueError("give path (a model the run serves) or base_url (an OpenAI-compatible server), one of "
                             "them")
        if self.api_key_env is not None and self.base_url is None:
            raise ValueError("api_key_env goes with base_url: a judge the run serves takes the run's key")
        return self

    @field_validator("template")
    @classmethod
    def _fields(cls, v: str) -> str:
        import string

        try:
            names = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
        except ValueError as e:
            raise ValueError(f"{e} (write a literal brace as {{{{ or }}}})") from None
        if names - JUDGE_FIELDS or "completion" not in names:
            raise ValueError(f"uses {sorted(names) or 'no field'}; it takes {{prompt}}, {{answer}} and must hold "
                             f"{{completion}}")
        try:
            v.format(prompt="", completion="", answer="")
        except (ValueError, KeyError, IndexError) as e:
            raise ValueError(f"cannot be filled ({type(e).__name__}: {e}); write the fields as {{completion}}, without "
                             f"a format spec or conversion") from None
        return v

    @field_validator("score_regex")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            groups = re.compile(v).groups
        except re.error as e:
            raise ValueError(f"not a regular expression ({e})") from None
        if groups < 1:
            raise ValueError("needs a group around the number, e.g. 'Score: (\\d+)'")
        return v


class RewardCfg(Section):
    """Where each sample's reward comes from: the task's function and, with [reward.model] and [reward.judge], a
    reward model's and an LLM judge's scores (docs/rewards-from-models.md)."""

    task_weight: float = Field(1.0, allow_inf_nan=False)
    """What the task's own reward counts (0: the models' scores alone). Eval sets always score with the task's
    reward."""
    model: RewardModelCfg | None = None
    """A reward model the run serves; unset: none."""
    judge: JudgeCfg | None = None
    """An LLM judge; unset: none."""

    @model_validator(mode="after")
    def _some_reward(self):
        models = [m for m in (self.model, self.judge) if m is not None]
        if not models and self.task_weight != 1.0:
            raise ValueError("reward.task_weight without [reward.model] or [reward.judge]: the task's reward is the "
                             "only one; remove the key or add a model")
        if models and self.task_weight == 0 and all(m.weight == 0 for m in models):
            raise ValueError("reward.task_weight and every model's weight are 0: nothing to learn from")
        return self


class Recipe(Section):
    cluster: ClusterCfg | None = None
    """Hosts for a multi-host run over SSH; unset: this machine."""
    placement: PlacementCfg | None = None
    """Which hosts run what (needs [cluster]); unset: the trainer on the first host, inference on the others."""
    run: RunCfg = RunCfg()
    """The run: its name and folder, seed, fault handling and logging."""
    model: ModelCfg = ModelCfg()
    """The model: a tiny random-init one, or a pretrained local folder."""
    task: TaskCfg = TaskCfg()
    """The prompts and their reward."""
    env: EnvCfg = EnvCfg()
    """The environment a rollout runs in."""
    sft: SftCfg = SftCfg()
    """The supervised warm start before RL."""
    rl: RlCfg = RlCfg()
    """The RL loop: steps, batch and group sizes, asynchrony, staleness and advantages."""
    sampling: SamplingCfg = SamplingCfg()
    """How the servers sample."""
    trainer: TrainerCfg = TrainerCfg()
    """The trainer: optimizer, ranks, precision, checkpoints, weight publishing, layout and loss."""
    inference: InferenceCfg = InferenceCfg()
    """The inference servers: backend, count, batching, precision and serving layout."""
    plan: PlanCfg = PlanCfg()
    """The hardware and workload assumptions of `prl plan`."""
    eval: dict[str, EvalCfg] = {}
    """Held-out evaluation sets by name (`[eval.<name>]`): scored during the run and by `prl eval`."""
    teacher: TeacherCfg | None = None
    """On-policy distillation from a frozen teacher the run serves; unset: none."""
    reward: RewardCfg = RewardCfg()
    """Rewards from models: the task reward's weight, a reward model and an LLM judge."""

    @model_validator(mode="after")
    def _teacher_where_built(self):
        if self.teacher is None:
            return self
        if self.cluster is not None:
            raise ValueError("teacher: a teacher on a [cluster] is not built yet: distil on one machine")
        if self.teacher.reward_weight == 0 and self.rl.filter_groups == "uniform":
            raise ValueError("teacher.reward_weight = 0 and rl.filter_groups = 'uniform': the filter drops groups "
                             "whose task rewards are equal, which still carry the teacher's signal; set "
                             "rl.filter_groups = 'none' or give the task reward a weight")
        if self.teacher.mode == "loss" and self.trainer.loss.kl_coef > 0:
            raise ValueError("teacher.mode = 'loss' and trainer.loss.kl_coef: the loss holds one KL term, to the "
                             "teacher or to a reference; set trainer.loss.kl_coef = 0 or teacher.mode = 'advantage'")
        if self.inference.fp8:
            raise ValueError("teacher: a teacher served with inference.fp8 is not built yet (the trainer publishes FP8 "
                             "weights for the policy, not the teacher): set inference.fp8 = false")
        if self.rl.credit == "turn":
            raise ValueError("teacher: per-turn credit (rl.credit = 'turn') and a teacher's per-token advantages do "
                             "not combine yet: set rl.credit = 'trajectory'")
        return self

    @model_validator(mode="after")
    def _reward_models_where_built(self):
        if self.reward.model is not None and self.cluster is not None:
            raise ValueError("reward.model: a reward model on a [cluster] is not built yet: serve it on one machine")
        judge = self.reward.judge
        if judge is not None and judge.path is not None and self.cluster is not None:
            raise ValueError("reward.judge.path: a judge the run serves on a [cluster] is not built yet: give its "
                             "base_url, or run on one machine")
        if judge is not None and judge.api_key_env is not None and self.cluster is not None:
            raise ValueError("reward.judge.api_key_env: carrying an API key to a [cluster]'s orchestrator is not built "
                             "yet: run on one machine, or use a judge without a key")
        if judge is not None and judge.path is not None and self.inference.backend != "embedded":
            raise ValueError("reward.judge.path: the run serves a judge on the embedded engine: set inference.backend "
                             "= 'embedded', or serve the judge yourself (vLLM's OpenAI server) and give its base_url")
        return self

    @model_validator(mode="after")
    def _replay_needs_moe(self):
        if self.trainer.router_replay and self.model.path is None and self.model.first_dense_layers >= self.model.num_layers:
            raise ValueError(
                f"trainer.router_replay needs an MoE model, but every layer is dense (model.first_dense_layers "
                f"{self.model.first_dense_layers} >= model.num_layers {self.model.num_layers}); "
                f"set trainer.router_replay = false or add MoE layers"
            )
        return self

    @model_validator(mode="after")
    def _replay_is_eager(self):
        if self.trainer.router_replay and self.inference.compile:
            raise ValueError("trainer.router_replay captures the experts each forward chose, which the embedded "
                             "engine does only in eager forwards; set inference.compile = false")
        return self

    @model_validator(mode="after")
    def _streamed_weights(self):
        """cluster.weight_transfer = "nccl" is the cluster's name for the stream from every trainer rank."""
        if self.cluster is not None and self.cluster.weight_transfer == "nccl":
            if self.trainer.weight_transfer == "collective":
                raise ValueError("cluster.weight_transfer = 'nccl' streams from every trainer rank, "
                                 "trainer.weight_transfer = 'collective' from rank 0 only: set one of them")
            self.trainer.weight_transfer = "stream"
        return self

    @model_validator(mode="after")
    def _placement(self):
        if self.cluster is None:
            if self.placement is not None:
                raise ValueError("[placement] needs a [cluster] section listing the hosts")
            if self.inference.kv_pool.host is not None:
                raise ValueError(f"inference.kv_pool.host = {self.inference.kv_pool.host!r} names a cluster host; on one "
                                 f"machine the master runs beside the servers (at inference.host): remove it")
            inf = self.inference
            if inf.prefill_servers and inf.prefill_servers >= inf.num_servers:
                raise ValueError(f"inference.prefill_servers ({inf.prefill_servers}) must leave at least one of "
                                 f"inference.num_servers ({inf.num_servers}) to decode")
            return self
        check_placement(self.cluster, self.placement_or_default(), self.trainer.nproc)
        inf = self.inference
        p = self.placement_or_default()
        servers = sum(p.servers_on(self.cluster.hosts_by_id()[n]) for n in p.inference)
        if inf.prefill_servers and inf.prefill_servers >= servers:
            raise ValueError(f"inference.prefill_servers ({inf.prefill_servers}) must leave at least one of the "
                             f"{servers} servers of placement.inference to decode")
        if inf.kv_pool.host is not None and inf.kv_pool.host not in self.cluster.hosts_by_id():
            raise ValueError(f"inference.kv_pool.host = {inf.kv_pool.host!r}: not a host name from cluster.hosts "
                             f"({', '.join(self.cluster.hosts_by_id())})")
        ignored = sorted(k for k in ("num_servers", "host", "port") if getattr(inf, k) != type(inf).model_fields[k].default)
        if ignored:
            raise ValueError(f"inference.{', inference.'.join(ignored)}: not used with [cluster]; servers come from "
                             f"[placement] (gpus_per_server), bind their host's address, and use "
                             f"cluster.inference_port")
        return self

    @model_validator(mode="after")
    def _serving_layout(self):
        """The layout's fit to the hosts: whole hosts per multi-host engine, replicas dividing a host's GPUs."""
        inf = self.inference
        if self.cluster is None:
            if inf.hosts_per_engine > 1:
                raise ValueError(f"inference.hosts_per_engine ({inf.hosts_per_engine}): an engine over several hosts "
                                 f"needs a [cluster]; on one machine use 1")
            return self
        p, hosts = self.placement_or_default(), self.cluster.hosts_by_id()
        if len(p.inference) % inf.hosts_per_engine:
            raise ValueError(f"inference.hosts_per_engine ({inf.hosts_per_engine}) must divide the "
                             f"{len(p.inference)} hosts of placement.inference")
        split = [n for n in p.inference if p.servers_on(hosts[n]) > 1]
        if inf.hosts_per_engine > 1 and split:
            raise ValueError(f"inference.hosts_per_engine ({inf.hosts_per_engine}) takes whole hosts: "
                             f"placement.gpus_per_server ({p.gpus_per_server}) must be all of host {split[0]}'s "
                             f"{hosts[split[0]].gpus} GPUs")
        if p.gpus_per_server % inf.local_replicas():
            raise ValueError(f"inference.data_parallel_size: {inf.local_replicas()} replicas per host must divide "
                             f"placement.gpus_per_server ({p.gpus_per_server}): each replica is tensor parallel over "
                             f"an equal share of the GPUs")
        return self

    def placement_or_default(self) -> PlacementCfg:
        if self.placement is not None:
            return self.placement
        ids = [h.id for h in self.cluster.hosts]
        return PlacementCfg(trainer=ids[:1], inference=ids[1:] or ids[:1])

    def trainer_world(self) -> int:
        hosts = 1 if self.cluster is None else len(self.placement_or_default().trainer)
        return self.trainer.nproc * hosts

    @model_validator(mode="after")
    def _parallel(self):
        par = self.trainer.parallel
        moe = self.model.path is None and self.model.first_dense_layers < self.model.num_layers
        par.check(self.trainer_world(), self.model.num_experts if self.model.path is None else None,
                  self.trainer.nproc)
        if par.ep > 1 and self.model.path is None and not moe:
            raise ValueError("trainer.parallel.ep > 1 needs an MoE model, but every layer is dense")
        return self

    def not_built(self) -> list[str]:
        """Valid settings whose implementation does not exist yet: `prl plan` and `--dry-run` take
        them (the flagship plan needs them), `prl run` refuses them before starting anything. The
        recipe's own; `prl.launch.checks.not_built` adds the backend's."""
        out = []
        pool = self.inference.kv_pool
        if pool.enabled and pool.protocol == "rdma":
            out.append("inference.kv_pool.protocol = 'rdma': only the TCP transport is built and tested; use 'tcp'")
        if self.trainer.checkpoint_format == "sharded" and self.trainer_hosts() > 1 and not self.shared_checkpoints():
            out.append("trainer.checkpoint_format = 'sharded' with the trainer on several hosts needs "
                       "cluster.shared_checkpoints (a folder every trainer host mounts): every rank may read every "
                       "host's shards when it resumes; set it, or use 'auto'")
        return out + self.lora_not_built()

    def lora_not_built(self) -> list[str]:
        lora, out = self.trainer.lora, []
        routed = lora.enabled and "routed_experts" in lora.targets
        if routed and (self.trainer.parallel.ep > 1 or self.trainer.fp8 or self.inference.backend != "embedded"):
            out.append("trainer.lora.targets = 'routed_experts' is built for the embedded engine with "
                       "trainer.parallel.ep = 1 and no trainer.fp8 only: adapters on experts split over ranks, on FP8 "
                       "experts or served by vLLM are not built yet; leave 'routed_experts' out")
        if lora.enabled and self.inference.fp8:
            out.append("trainer.lora with inference.fp8: the servers would merge each adapter into block-FP8 weights, "
                       "which is not built yet; serve in bf16 (inference.fp8 = false) or train without LoRA")
        return out

    def server_count(self) -> int:
        if self.cluster is None:
            return self.inference.num_servers
        p, hosts = self.placement_or_default(), self.cluster.hosts_by_id()
        return sum(p.servers_on(hosts[n]) for n in p.inference)

    def shared_checkpoints(self) -> str | None:
        return self.cluster.shared_checkpoints if self.cluster is not None else None

    def trainer_hosts(self) -> int:
        if self.cluster is None:
            return 1
        return len(self.placement.trainer) if self.placement is not None else 1

    @model_validator(mode="after")
    def _cross(self):
        """What the RL settings ask of each other. (The sample's length against the model and the micro-batch,
        and what turn credit and the warm start ask of the environment class, are checked at launch:
        `prl.launch.checks`.)"""
        if self.rl.credit == "turn" and self.trainer.loss.correction == "gspo":
            raise ValueError("trainer.loss.correction = 'gspo' gives each sample one advantage; rl.credit = 'turn' gives "
                             "each turn its own: use 'gspo_token' (GSPO's token variant), or rl.credit = 'trajectory'")
        if self.rl.credit == "turn" and self.rl.loss_weighting == "sequence":
            raise ValueError("rl.loss_weighting = 'sequence' has no effect with rl.credit = 'turn' (each turn's tokens "
                             "carry their own advantage, compared within the same turn): use one of them")
        return self

    @model_validator(mode="after")
    def _evals(self):
        for name, ev in self.eval.items():
            check_eval(self, name, ev)
        return self

    def eval_points(self) -> list[int]:
        """The steps whose weights some eval set scores, ascending."""
        return sorted({p for ev in self.eval.values() for p in ev.points(self.rl.max_steps)})

    def training_reach(self) -> int:
        """Example indices the training data can reach: every step's groups, the overprovisioned ones and the
        groups filtering may drop (`RlCfg.filter_bound` per step); a stale group dropped takes one more, refused
        at run time should it reach an eval set."""
        groups = self.rl.batch_size // self.rl.group_size
        return self.rl.max_steps * (groups + self.rl.filter_bound()) + math.ceil(self.rl.overprovision * groups)


def check_eval(recipe: "Recipe", name: str, ev: EvalCfg) -> None:
    """One eval set against the recipe, each refusal naming the key."""
    key = f"eval.{name}"
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"[{key}]: a set's name takes letters, digits, '_' and '-'")
    if ev.pass_k[-1] > ev.samples:
        raise ValueError(f"{key}.pass_k: k = {ev.pass_k[-1]} is larger than {key}.samples ({ev.samples}); "
                         f"sample at least k completions per example")
    if ev.temperature == 0 and ev.samples > 1:
        raise ValueError(f"{key}.samples = {ev.samples} at {key}.temperature = 0: greedy samples are all the same; "
                         f"set a temperature > 0 or samples = 1")
    if not ev.points(recipe.rl.max_steps):
        raise ValueError(f"{key}: at_start, every and at_end leave the set no step to score; set one of them")
    if ev.samples > ev.max_share * recipe.rl.max_inflight_rollouts:
        raise ValueError(f"{key}.samples ({ev.samples}) exceed its share of the in-flight budget ({key}.max_share "
                         f"{ev.max_share} x rl.max_inflight_rollouts {recipe.rl.max_inflight_rollouts}): one example "
                         f"would hold more than the set may; raise max_share or lower samples")
    check_eval_data(recipe.task, key, ev)
    start, reach = ev.start(recipe.task), recipe.training_reach()
    if ev.draws_training_data(recipe.task) and start < reach:
        raise ValueError(f"{key}.first_index ({start}) overlaps the training indices 0..{reach - 1} (rl.max_steps x "
                         f"rl.batch_size / rl.group_size, with rl.overprovision and rl.max_filtered_per_step): leave it unset, or set it >= {reach}")


def check_eval_data(task: TaskCfg, key: str, ev: EvalCfg) -> None:
    """A set reading a dataset file reads none of the training file's rows."""
    if ev.rows is not None and ev.data is None:
        raise ValueError(f"{key}.rows is for a set's dataset file: set {key}.data")
    if task.is_file() and ev.data is None and ev.task is None:
        raise ValueError(f"{key}: the training task reads task.data = {task.data!r}; give the set a file of its own "
                         f"({key}.data = \"test.jsonl\"), or the same file with {key}.rows apart from task.rows")
    try:
        own = ev.set_task(task)
    except ValueError as e:
        raise ValueError(f"{key}.data: {e} (set it in [task] or [{key}.task])") from None
    if not (task.is_file() and own.is_file()) or os.path.realpath(task.data) != os.path.realpath(own.data):
        return
    a, b = task.rows or [0, math.inf], own.rows or [0, math.inf]
    if a[0] < b[1] and b[0] < a[1]:
        raise ValueError(f"{key}: reads {own.data!r}, the training file, at rows training draws (task.rows = "
                         f"{task.rows}, {key}.rows = {own.rows}): give both rows ranges that do not overlap, e.g. "
                         f"task.rows = [0, 9000] and {key}.rows = [9000, 10000]")


def check_placement(cluster: ClusterCfg, p: PlacementCfg, trainer_nproc: int) -> None:
    hosts = {}
    for h in cluster.hosts:
        if h.id in hosts:
            raise ValueError(f"cluster.hosts: two hosts are named {h.id!r}; give each a distinct name")
        hosts[h.id] = h
    for key, names in (("trainer", p.trainer), ("inference", p.inference), ("sandbox", p.sandbox or [])):
        unknown = [n for n in names if n not in hosts]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"placement.{key}: {unknown or names} - each entry must be a distinct host name "
                             f"from cluster.hosts ({', '.join(hosts)})")
    if p.orchestrator not in (None, "workstation", *hosts):
        raise ValueError(f"placement.orchestrator = {p.orchestrator!r}: not a host name or 'workstation'")
    for n in p.trainer:
        if hosts[n].gpus and trainer_nproc > hosts[n].gpus:
            raise ValueError(f"trainer.nproc ({trainer_nproc}) ranks per trainer host exceed host {n}'s "
                             f"{hosts[n].gpus} GPUs")
    for n in p.inference:
        if hosts[n].gpus and p.gpus_per_server > hosts[n].gpus:
            raise ValueError(f"placement.gpus_per_server ({p.gpus_per_server}) exceeds host {n}'s "
                             f"{hosts[n].gpus} GPUs")
