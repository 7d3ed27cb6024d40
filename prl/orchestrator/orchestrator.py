"""The orchestrator: keeps inference saturated, scores groups, ships packed batches, relays weights.

Rollouts go through the recipe's environment (`prl.envs`): the orchestrator hands it one example and
a handle to the server pool, and gets back a scored group; turns, tools and sandboxes are the
environment's. Rules:
- staleness is explicit: groups for step s start only while the served version is at least
  s - max_async_level (0 = synchronous); a token more than max_off_policy_steps behind the step
  that trains it is masked, corrected or its group dropped, as `rl.stale_policy` says, and counted
  (`GroupBuffer`); every step reports the lengths generated and trained (the policy's length bias);
- a group whose rewards do not spread is dropped before the buffer and replaced, a bounded number
  per step, as `rl.filter_groups` says (`GroupFilter`), its prompt consumed;
- rollouts in flight follow the servers' KV usage (`InflightBudget`), at most max_inflight_rollouts;
- a new policy is relayed to every server as soon as the trainer seals it;
- batches go to the trainer endpoint (rank 0), which also says where a resumed run starts;
- eval sets (`[eval.<name>]`) run beside the rollouts at a bounded share of the budget, each
  starting under the version it scores (`prl.orchestrator.evals`).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import sys
import time
from collections.abc import Callable

from prl.envs import SkipExample, make_env
from prl.envs.stats import summarize
from prl.evaluation.sets import build_sets, run_streams
from prl.tasks.files import row_count
from prl.inference.protocol import GenerateRequest, GenerateResponse
from prl.metrics import EventLog, reporting_errors
from prl.orchestrator.budget import InflightBudget
from prl.orchestrator.buffer import DataCursor, Group, GroupBuffer, GroupFilter, uniform
from prl.orchestrator.evals import InRunEvals
from prl.orchestrator.models import ModelClients
from prl.orchestrator.rewards import RewardUnavailable, step_figures
from prl.orchestrator.samples import SampleWriter
from prl.orchestrator.servers import Home, ServerPool
from prl.backends import registry
from prl.backends.base import InferenceBackend
from prl.recipe.roles import OrchestratorConfig
from prl.system import freeze_heap
from prl.transport import ports
from prl.transport.batch import Sample, TrainBatch, pack
from prl.transport.trainer_client import TrainerClient
from prl.usercode import EXIT_USER_ERROR, UserCodeError, blame, write_example


def group_advantages(rewards: list[float], mode: str) -> list[float]:
    """Group-relative advantages: reward minus the group mean (divided by the std for mean_std)."""
    mean = sum(rewards) / len(rewards)
    adv = [r - mean for r in rewards]
    if mode == "mean_std":
        std = statistics.pstdev(rewards)
        adv = [a / (std + 1e-6) for a in adv]
    return adv


def sequence_weighted(advantages: list[float], model_tokens: list[int]) -> list[float]:
    """Advantages scaled by the group's mean model tokens over each member's own (`rl.loss_weighting =
    "sequence"`): the trainer sums the loss over tokens, so each member then weighs the same whatever
    its length, and a group's advantages cancel (sum(A_i) = 0) instead of its long members (many
    turns, usually failed ones) outweighing its short ones."""
    mean = sum(model_tokens) / len(model_tokens)
    return [a * mean / max(n, 1) for a, n in zip(advantages, model_tokens)]


def turn_advantages(trajs) -> list[list[float]] | None:
    """`rl.credit = "turn"`: each model turn's tokens get that turn's reward (`Trajectory.turn_rewards`;
    code: the score had the episode ended there) minus the mean of the same turn over the members that
    reached it, in the same state where the environment says (`turn_states`: tools, the results got so
    far), so a failed first attempt is not credited with a later fix, a fix is compared with the other
    fixes, and an answer with the answers to the same tool results (alone in its state: 0). Per
    completion token (environment tokens 0); None when the environment does not score turns."""
    if any(t.turn_rewards is None for t in trajs):
        return None
    def key(t, k):
        return (k, t.turn_states[k]) if t.turn_states is not None else (k,)

    groups: dict = {}
    for t in trajs:
        for k, r in enumerate(t.turn_rewards):
            groups.setdefault(key(t, k), []).append(r)
    out = []
    for t in trajs:
        turn, prev, adv = -1, 0, []
        for m in t.mask if t.mask is not None else [1] * len(t.completion_ids):
            turn += bool(m and not prev)
            prev = m
            if m and 0 <= turn < len(t.turn_rewards):
                rs = groups[key(t, turn)]
                adv.append(t.turn_rewards[turn] - sum(rs) / len(rs))
            else:
                adv.append(0.0)
        out.append(adv)
    return out


SKIPS_LOGGED = 20  # example_skipped events a run writes; past them, orch_step's skipped_examples counts
SKIPS_IN_A_ROW = 1000  # examples skipped with none run between them: the data is not usable, the run stops
UNSCORED_IN_A_ROW = 32  # groups in a row a model gave no score: the judge or reward model is unusable, the run stops


class GroupSampler:
    """The environment's handle to the inference pool, bound to one group: P/D prefill first (best
    effort), then the request on the group's server, re-issued elsewhere if that server goes down.
    It counts the sequences its requests have out (`Rollouts`), which the in-flight budget limits; where
    the backend streams members (the embedded engine), each member's place frees as it finishes, so a
    group waiting on its slowest member holds only what it has still running."""

    def __init__(self, pool: ServerPool, index: int, rollouts: "Rollouts"):
        self.pool, self.index, self.rollouts = pool, index, rollouts
        self.homes: dict[int, Home] = {}  # per conversation: the server its KV is on
        self.started = False

    async def generate(self, req: GenerateRequest, conversation: object = None) -> GenerateResponse:
        if not self.started:
            self.started = True
            self.rollouts.pending -= 1
        out = req.n  # of this request's members, those counted in flight
        self.rollouts.active += req.n

        def freed(member: int) -> None:  # a member finished (a streaming backend says so): its place frees
            nonlocal out
            out -= 1
            self.rollouts.active -= 1
            asyncio.ensure_future(self.rollouts.notify())

        def attempt(backend: InferenceBackend, release: Callable[[], None]):
            nonlocal out  # each (re-)issue counts every member in flight again
            self.rollouts.active += req.n - out
            out = req.n
            return backend.generate(req, on_member=lambda member: (release(), freed(member)))

        try:
            await self.pool.prefill(self.index, req.prompt_ids)  # P/D: the prompt's KV into the pool
            home = self.homes.setdefault(id(conversation), Home())  # None: the group's one-turn request
            return await self.pool.call(self.index, attempt, req.n, home)
        finally:
            self.rollouts.active -= out
            await self.rollouts.notify()


class Rollouts:
    """What is in flight: sequences the servers are generating (`active`), and groups started that
    have sent no request yet (`pending`, each counted as a whole group). A group waiting on its last
    member, or on a tool between turns, holds only what it has out."""

    def __init__(self, changed: asyncio.Condition, group_size: int):
        self.changed, self.group_size = changed, group_size
        self.active = self.pending = 0

    def count(self) -> int:
        return self.active + self.pending * self.group_size

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig):
        from prl.model.build import load_tokenizer

        self.cfg, r = cfg, cfg
        self.rl, self.sampling = r.rl, r.sampling
        self.tokenizer = load_tokenizer(cfg.model_dir)
        self.sandbox = self.sandbox_client()
        self.env = make_env(cfg.env, cfg.task, cfg.run.seed, self.tokenizer, cfg.sampling, cfg.rl.group_size,
                            cfg.router_replay, sandbox=self.sandbox)
        self.log = EventLog(cfg.run_path / "metrics.jsonl", cfg.name)
        self.changed = asyncio.Condition()
        self.pool = ServerPool([self.backend(i, u) for i, u in enumerate(cfg.servers)], self.log, self.changed, r.run.hang_timeout_s,
                               cfg.startup_timeout_s, prefill=cfg.prefill_servers)
        self.trainer = TrainerClient(cfg.trainer_url, cfg.secret(), hang_timeout_s=r.run.hang_timeout_s,
                                     on_hang=self.trainer_hung, locate=self.locator("trainer", cfg.trainer_url))
        self.buffer = GroupBuffer(r.rl.max_off_policy_steps, r.rl.stale_policy, GroupFilter(
            r.rl.filter_groups, r.rl.filter_min_std, r.rl.filter_bound(), r.rl.max_steps))
        self.budget = InflightBudget(r.rl.max_inflight_rollouts, r.rl.group_size, len(cfg.servers), r.rl.kv_usage_target,
                                     prefill=cfg.prefill_servers)
        models = ModelClients(cfg, self.tokenizer, self.log, self.locator)
        self.teacher, self.rewards = models.teacher(), models.rewards()
        self.reward_dropped = self.reward_dropped_total = 0  # groups a model gave no score: since the batch, in all
        self.unscored_in_a_row = 0  # since the last group a model scored
        self.judge_unparsed = 0  # judge answers that gave no score, since the last batch
        self.pool.on_metrics = self.observe_kv
        self.pool.room = self._room
        self.groups_per_batch = r.rl.batch_size // r.rl.group_size
        self.served = -1
        self.inflight_groups = 0
        self.groups_started = 0  # since the last batch shipped
        self.skipped_examples = 0  # examples the environment would not run (SkipExample), since the start
        self.skipped_in_a_row = 0  # since the last group that ran
        self.examples_ended = 0  # groups that ended (ran, skipped or failed) since the start
        self.user_errors = self.user_errors_total = 0  # examples dropped for the user's errors: since the last batch, in all
        self.data_rows = row_count(r.task)  # a dataset file's rows (None: generated examples)
        self.samples = SampleWriter(cfg.run_path, r.run.samples_per_step, r.run.seed, self.tokenizer)
        self.rollouts = Rollouts(self.changed, r.rl.group_size)
        self.eval_requests = Rollouts(self.changed, r.rl.group_size)  # an eval set's, beside the budget's rollouts
        self.error: Exception | None = None
        self.start_step = self.next_prompt = self.committed = 0  # set from the trainer in start()
        self.cursor = DataCursor()  # prompts consumed (trained or dropped), shipped with every batch
        self.tasks: list[asyncio.Task] = []
        self.groups: set[asyncio.Task] = set()  # in-flight rollout groups, held so they are cancelled on stop
        sets = build_sets(cfg.eval, cfg.task, cfg.env, cfg.sampling, cfg.run.seed, self.tokenizer, sandbox=self.sandbox,
                          training=run_streams(cfg, self.env, self.tokenizer))
        self.evals = InRunEvals(self, sets, r.rl.max_steps)
        self.held_out = self.evals.held_out_from()  # training's example indices stay below it

    def backend(self, index: int, url: str) -> InferenceBackend:
        cap = self.rl.max_inflight_rollouts
        conns = cap + 8 + sum(math.ceil(e.max_share * cap) for e in self.cfg.eval.values())  # eval sets beside
        spec = registry.get(self.cfg.backend)
        client = spec.make_client(url, self.cfg.secret(), conns, **spec.client_options(self.tokenizer, self.cfg))
        client.locate = self.locator(f"inference-{index}", url)
        return client

    def sandbox_client(self):
        """The run's sandbox workers (an environment that needs the sandbox), None without them."""
        if not self.cfg.sandboxes:
            return None
        from prl.sandbox.client import SandboxClient

        sb = self.cfg.env.sandbox
        return SandboxClient(self.cfg.sandboxes, self.cfg.secret(), sb.concurrency, sb.timeout_s,
                             unavailable_s=self.cfg.startup_timeout_s,
                             locate=(lambda i, u: self.locator(f"sandbox-{i}", u)()) if self.cfg.port_fallback else None,
                             on_hang=lambda i, cause: self.log.emit("unresponsive", name=f"sandbox-{i}", cause=cause))

    def locator(self, name: str, url: str):
        """On one machine a process publishes where it listens (`prl.transport.ports`); None on a
        cluster, where ports are configured."""
        if not self.cfg.port_fallback:
            return None
        return lambda: ports.url_of(self.cfg.run_dir, name, url)

    def observe_kv(self, server, metrics) -> None:
        self.budget.observe(server.index, metrics.kv_usage, max(self.rollouts.count(), self.evals.wanted()))

    def _room(self, server, n: int) -> bool:
        """Whether `server` can take n more sequences: its rollout limit, plus the eval sets' sequences in flight
        (beside the budget; counted over all servers, so a server running them may go over its share by as much)."""
        return server.active + n <= self.budget.limits[server.index] + self.eval_requests.active

    def inflight_budget(self) -> int:
        return self.budget.total([s.up for s in self.pool.servers])

    def trainer_hung(self, cause: str) -> None:
        self.log.emit("unresponsive", name="trainer", cause=cause[:300])

    # ---- main loop ----
    async def run(self) -> None:
        self.tasks = [asyncio.create_task(self.beat())]
        try:
            await self.start()
            for step in range(self.start_step, self.rl.max_steps):
                t0 = time.perf_counter()
                groups, ages, dropped = await self.next_groups(step)
                await self.evals_started(step)
                await self.ship(step, groups, {**ages, "stale_dropped": dropped}, time.perf_counter() - t0)
            await self.evals.finish()
            await self.pool.report_final()
            if self.cfg.eval:  # the trainer serves until the last eval is logged
                await self.trainer.finished()
        finally:
            await self.stop()

    async def beat(self) -> None:
        """Proof of life for the driver, which restarts an orchestrator that stays silent for
        run.hang_timeout_s (the event loop is stuck, or the process stopped)."""
        while True:
            self.log.emit("beat")
            await asyncio.sleep(min(5.0, self.cfg.run.hang_timeout_s / 4))

    async def start(self) -> None:
        self.log.emit("orchestrator", state="waiting for the trainer")
        if self.env.needs_sandbox and self.cfg.env.sandbox.isolation == "none":  # shown by the dashboard
            self.log.emit("error", name=self.cfg.name, line="env.sandbox.isolation = 'none': model-written code "
                          "runs without namespaces (its own uid and rlimits only)")
        self.start_step, position, ahead = await self.trainer.resume_point()
        self.cursor = DataCursor(position, ahead)
        self.next_prompt = self.cursor.position
        self.committed = self.start_step * self.groups_per_batch  # groups shipped, buffered or in flight
        self.buffer.filter.step = self.start_step
        await self.pool.start(self.cfg.startup_timeout_s)
        for frozen in self.frozen_servers():
            await frozen.start(self.cfg.startup_timeout_s)
        self.log.emit("orchestrator", state="waiting for weights", step=self.start_step)
        # groups for step s may start under version s - max_async_level (a restarted orchestrator
        # may continue ahead of the trainer, which replays the batches it already has)
        await self.relay_weights(wait_for=max(0, self.start_step - self.rl.max_async_level))
        background = (self.produce(), self.watch_weights(), self.log_rollouts(), self.evals.watch(),
                      *(self.pool.watch(s) for s in self.pool.servers))
        self.tasks += [asyncio.create_task(self.guard(t)) for t in background]

    async def guard(self, coro) -> None:
        """A background task that fails stops the main loop (via next_groups) instead of dying silently."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a background task ends the run, named
            async with self.changed:
                self.error = self.error or e
                self.changed.notify_all()

    async def stop(self) -> None:
        pending = [*self.tasks, *self.groups]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(s.backend.close() for s in self.pool.servers),
                             *(f.close() for f in self.frozen_servers()), self.trainer.close())
        if self.sandbox is not None:
            await self.sandbox.close()

    def frozen_servers(self) -> list:
        return [*([self.teacher.servers] if self.teacher is not None else []),
                *(self.rewards.servers if self.rewards is not None else [])]

    def eval_sampler(self, index: int) -> GroupSampler:
        """The pool for one eval example: like a group's, never pending, counted apart from the rollouts (its
        set's `ShareGate` bounds them, beside the budget training keeps whole)."""
        sampler = GroupSampler(self.pool, index, self.eval_requests)
        sampler.started = True
        return sampler

    async def evals_started(self, step: int) -> None:
        """The batch of `step` ships once every eval of the versions up to `step` has started under them."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.evals.started_through(step) or self.error)
            if self.error:
                raise self.error

    # ---- batches ----
    async def next_groups(self, step: int) -> tuple[list[Group], dict, int]:
        """The oldest groups for `step`, their token ages, and how many samples were dropped as stale
        meanwhile (the "drop" policy)."""
        dropped = 0
        async with self.changed:
            while True:
                stale = self.buffer.drop_stale(step)
                if stale:
                    self.release(stale)
                    dropped += sum(len(g.samples) for g in stale)
                if self.error:
                    raise self.error
                if len(self.buffer) >= self.groups_per_batch:
                    return *self.buffer.take(self.groups_per_batch, step), dropped
                await self.changed.wait()

    def release(self, groups: list[Group]) -> None:
        """Groups that will never be trained (dropped as stale, or filtered): their prompts are consumed,
        not retried, and their budget freed, so replacements start (under newer weights). Caller holds
        `self.changed`."""
        self.consume_unrun([g.prompt_index for g in groups])

    def consume_unrun(self, indices: list[int]) -> None:
        """Example indices that will never be trained: consumed by the cursor, their budget freed. Caller holds
        `self.changed`."""
        self.committed -= len(indices)
        self.cursor.consume(indices)
        self.changed.notify_all()

    async def ship(self, step: int, groups: list[Group], ages: dict, wait_s: float) -> None:
        samples = [s for g in groups for s in g.samples]
        self.cursor.consume(g.prompt_index for g in groups)  # groups finish out of order: see DataCursor
        position, ahead = self.cursor.state()
        # read with the cursor, before any await: the groups filtered so far are those it consumed
        counts = {**ages, **self.buffer.filter.shipped(step), "groups_started": self.groups_started,
                  "skipped_examples": self.skipped_examples, "user_errors": self.user_errors,
                  **self.reward_counts(groups),
                  **self.data_epoch(position),
                  "groups_uniform": sum(uniform(g, self.rl.filter_min_std) for g in groups), **teacher_kl(groups)}
        self.groups_started = self.user_errors = self.reward_dropped = self.judge_unparsed = 0
        self.samples.write_step(step, groups)
        rows = pack(samples, self.cfg.data_parallel, self.cfg.micro_batch_tokens, self.cfg.share_prompts)
        batch = TrainBatch(step=step, micro_batches=rows,
                           data_position=position, data_ahead=ahead, prompt_indices=[g.prompt_index for g in groups])
        await self.trainer.send_batch(batch)
        env = summarize([i for g in groups for i in g.infos])
        self.log_step(step, samples, batch.data_position, {**counts, **self.buffer.lengths.fields(samples), **env,
                                                            "data_ahead": len(ahead)}, wait_s)

    def log_step(self, step: int, samples: list[Sample], data_position: int, extra: dict, wait_s: float) -> None:
        lags = [step - v for s in samples for v in s.model_versions()] or [0]  # of the tokens trained
        rewards = [s.reward for s in samples]
        self.log.emit(
            "orch_step", step=step, reward=sum(rewards) / len(rewards),
            reward_std=statistics.pstdev(rewards), completion_len=sum(len(s.completion_ids) for s in samples) / len(samples),
            stale_dropped_total=self.buffer.dropped_samples, stale_policy=self.buffer.policy,
            off_policy_mean=sum(lags) / len(lags), off_policy_max=max(lags),
            inflight=self.rollouts.count(), inflight_groups=self.inflight_groups, inflight_budget=self.inflight_budget(),
            served_version=self.served, buffered=len(self.buffer), wait_s=round(wait_s, 4), data_position=data_position, **extra,
        )

    # ---- rollouts ----
    def _budget_open(self) -> bool:
        """Groups for the steps up to served + max_async_level, plus `rl.overprovision` of a step's more
        (partial rollouts: the first groups to finish are trained, the rest carry into later steps
        under new weights), while the servers' KV holds them."""
        allowed_step = min(self.served + self.rl.max_async_level, self.rl.max_steps - 1)
        extra = math.ceil(self.rl.overprovision * self.groups_per_batch)
        inflight = self.rollouts.count()
        return (
            self.committed < (allowed_step + 1) * self.groups_per_batch + extra
            and inflight + self.rl.group_size <= self.inflight_budget()
        )

    async def produce(self) -> None:
        while True:
            async with self.changed:
                await self.changed.wait_for(self._budget_open)
                index = self.cursor.next_free(self.next_prompt)  # after a restart: skip what was trained
                if self.held_out is not None and index >= self.held_out:
                    raise RuntimeError(f"training reached example index {index}, where an eval set's held-out "
                                       f"examples start: set its eval.<name>.first_index higher")
                self.next_prompt = index + 1
                self.committed += 1
                self.groups_started += 1
                self.inflight_groups += 1
                self.rollouts.pending += 1
            task = asyncio.create_task(self.run_group(index))
            self.groups.add(task)
            task.add_done_callback(self.groups.discard)

    async def run_group(self, index: int) -> None:
        sampler = GroupSampler(self.pool, index, self.rollouts)
        skipped = failed = unscored = None
        try:
            group = await self.rollout_group(index, sampler)
        except SkipExample as e:  # its index is consumed, and a replacement starts
            group, skipped = None, e
        except RewardUnavailable as e:  # dropped and counted, never scored 0
            group, unscored = None, e
        except (Exception, SystemExit) as e:  # noqa: BLE001 - surfaced by next_groups; a cancellation is not one
            group, failed = None, blame(e)
            if failed is None:  # prl's own: the orchestrator restarts
                self.error = self.error or (e if isinstance(e, Exception) else RuntimeError(f"SystemExit({e.code!r})"))
        finally:
            if not sampler.started:  # ended before its first request
                self.rollouts.pending -= 1
        async with self.changed:
            self.inflight_groups -= 1
            self.examples_ended += 1
            if group and not self.buffer.add(group):  # filtered: a replacement starts
                self.release([group])
            if skipped is not None:
                self.skip(index, skipped)
            elif failed is not None:
                self.user_error(index, failed.on_example(index))
            elif unscored is not None:
                self.unscored(index, unscored)
            elif group is not None:
                self.skipped_in_a_row = self.unscored_in_a_row = 0
            self.changed.notify_all()

    def data_epoch(self, position: int) -> dict:
        """A dataset file's epoch the data position is in (`data_epoch`), or nothing for generated examples."""
        return {"data_epoch": position // self.data_rows} if self.data_rows else {}

    def skip(self, index: int, why: SkipExample) -> None:
        """An example the environment will not run: consumed, counted, the first one said. Caller holds `self.changed`."""
        self.consume_unrun([index])
        self.groups_started -= 1
        self.skipped_examples += 1
        self.skipped_in_a_row += 1
        if self.skipped_examples <= SKIPS_LOGGED:
            self.log.emit("example_skipped", index=index, why=str(why), total=self.skipped_examples)
        if self.skipped_in_a_row >= SKIPS_IN_A_ROW:
            self.error = self.error or RuntimeError(f"{SKIPS_IN_A_ROW} examples skipped in a row, none run (the last, "
                                                    f"example {index}: {why}); fix the data or its keys")

    def unscored(self, index: int, why: RewardUnavailable) -> None:
        """A model gave no score for example `index`'s group: dropped and counted, the first ones said. Caller holds
        `self.changed`."""
        self.consume_unrun([index])
        self.groups_started -= 1
        self.reward_dropped += 1
        self.judge_unparsed += why.unparsed
        self.reward_dropped_total += 1
        self.unscored_in_a_row += 1
        if self.reward_dropped_total <= SKIPS_LOGGED:
            self.log.emit("reward_dropped", index=index, why=str(why)[:300], total=self.reward_dropped_total)
        if self.unscored_in_a_row >= UNSCORED_IN_A_ROW and self.error is None:  # the recipe's to fix: no restart
            self.error = UserCodeError(f"{UNSCORED_IN_A_ROW} groups in a row got no score (reward_dropped) from "
                                       f"[reward.model] or [reward.judge]; the last: {why}"[:600])

    def reward_counts(self, groups: list[Group]) -> dict:
        """The model rewards' figures for a step (nothing without a reward model or judge)."""
        if self.rewards is None:
            return {}
        judged = {"judge_unparsed": self.judge_unparsed} if self.rewards.judge is not None else {}
        return {**step_figures(groups), "reward_dropped": self.reward_dropped, **judged}

    def user_error(self, index: int, error: UserCodeError) -> None:
        """The user's code failed on example `index`: the run stops at once, the example written beside it; with
        env.on_error = "drop", the example is dropped and counted, and the run stops past env.max_error_share.
        Caller holds `self.changed`."""
        env = self.cfg.env
        if env.on_error == "stop":
            if self.error is None:  # the first: what the run says and writes (groups in flight may fail after it)
                self.error = error
                self.write_user_example(error)
            return
        self.consume_unrun([index])
        self.groups_started -= 1
        self.user_errors += 1
        self.user_errors_total += 1
        if self.user_errors_total <= SKIPS_LOGGED:
            self.log.emit("user_error", index=index, line=str(error)[:400], total=self.user_errors_total)
        if self.examples_ended >= 20 and self.user_errors_total > env.max_error_share * self.examples_ended \
                and self.error is None:
            self.error = UserCodeError(
                f"{self.user_errors_total} of {self.examples_ended} examples dropped for errors in your code, more "
                f"than env.max_error_share = {env.max_error_share:g}; the last: {error}", detail=error.detail)
            self.write_user_example(error)

    def write_user_example(self, error: UserCodeError) -> None:
        try:
            example = self.env.example(error.index)
        except Exception as e:  # noqa: BLE001 - the dataset itself may be what failed
            example = f"(the example could not be built: {type(e).__name__}: {e})"
        try:
            write_example(self.cfg.run_path, error, example)
        except OSError as e:  # the run still stops on the user's error, said in one line
            self.log.emit("user_error", index=error.index, line=f"could not write user_error.json: {e}"[:300])

    async def rollout_group(self, index: int, sampler: GroupSampler) -> Group:
        """One example through the environment; the group's advantages over its rewards."""
        example = self.env.example(index)
        trajs = checked_group(self.env, await self.env.rollout(example, sampler), self.rl.group_size)
        figures = {}
        if self.rewards is not None:
            trajs, figures = await self.rewards.rewarded(example, trajs)
        advantages = group_advantages([t.reward for t in trajs], self.rl.advantage)
        if self.rl.loss_weighting == "sequence":
            advantages = sequence_weighted(advantages, [sum(t.mask) if t.mask else len(t.completion_ids) for t in trajs])
        per_token = turn_advantages(trajs) if self.rl.credit == "turn" else None
        kl = taught = None
        if self.teacher is not None and self.teacher.cfg.mode == "loss":  # the trainer adds the KL to the teacher
            taught, kl = await self.teacher.scored(trajs)
            advantages = [self.teacher.cfg.reward_weight * a for a in advantages]
        elif self.teacher is not None:
            per_token, kl = await self.teacher.token_advantages(trajs, advantages)
        return Group(index, [Sample(t.prompt_ids, t.completion_ids, t.logprobs, t.versions, a, t.reward,
                                    routing=t.routing, mask=t.mask, token_advantages=per_token[i] if per_token else None,
                                    teacher_logprobs=taught[i] if taught else None)
                             for i, (t, a) in enumerate(zip(trajs, advantages))],
                     infos=[t.info or {} for t in trajs], teacher_kl=kl, figures=figures)

    # ---- weights ----
    async def relay_weights(self, wait_for: int | None = None) -> None:
        """Load the newest sealed version on every server (first waiting until `wait_for` exists).
        The trainer endpoint long-polls, so a new version is relayed as soon as it is sealed."""
        while True:
            v = await self.trainer.latest_version(after=max(self.served, (wait_for or 0) - 1))
            if v > self.served and (wait_for is None or v >= wait_for):
                break
            if wait_for is None:
                return
        async with self.changed:  # an eval set with pin_version keeps the version it scores on the servers
            await self.changed.wait_for(lambda: not self.evals.pinned)
        t0 = time.perf_counter()
        paused = await self.pool.load_all(v)
        async with self.changed:
            self.served = v
            self.changed.notify_all()
        self.log.emit("weights", version=v, relay_s=round(time.perf_counter() - t0, 4),
                      pause_s=round(max(paused, default=0.0), 4), servers=len(paused))

    async def watch_weights(self) -> None:
        while True:
            await self.relay_weights()

    async def log_rollouts(self) -> None:
        while True:
            self.log.emit("rollouts", inflight=self.rollouts.count(), groups=self.inflight_groups, buffered=len(self.buffer),
                          served_version=self.served, budget=self.inflight_budget())
            await asyncio.sleep(1.0)


def teacher_kl(groups) -> dict:
    """Distillation: the step's mean log p_student - log p_teacher over model tokens (nothing without a teacher)."""
    scored = [g.teacher_kl for g in groups if g.teacher_kl is not None]
    count = sum(n for _, n in scored)
    return {"teacher_kl": sum(s for s, _ in scored) / count} if count else {}


def checked_group(env, trajs, n: int) -> list:
    """What an environment's `rollout` returned, checked where it crosses into prl: `n` scored trajectories whose
    token lists agree; a UserCodeError naming the method otherwise."""
    from prl.envs import Trajectory
    from prl.tasks import users_reward

    name = f"{type(env).__name__}.rollout"
    if not isinstance(trajs, list) or len(trajs) != n or not all(isinstance(t, Trajectory) for t in trajs):
        got = f"a list of {len(trajs)}" if isinstance(trajs, list) else f"a {type(trajs).__name__}"
        raise UserCodeError(f"{name} returned {got}; it returns a list of rl.group_size = {n} prl.envs.Trajectory")
    for t in trajs:
        lengths = {len(t.completion_ids), len(t.logprobs), len(t.versions), len(t.mask or t.completion_ids)}
        if len(lengths) != 1:
            raise UserCodeError(f"{name}: a trajectory's completion_ids, logprobs, versions and mask differ in length "
                                f"({len(t.completion_ids)}, {len(t.logprobs)}, {len(t.versions)}, "
                                f"{len(t.mask or t.completion_ids)})")
        users_reward(t.reward, name)
    return trajs


def main(config_path: str) -> None:
    from prl.recipe.resolve import load_process_config

    cfg = load_process_config(config_path)
    try:
        with reporting_errors(EventLog(cfg.run_path / "metrics.jsonl", cfg.name), cfg.name):
            orch = Orchestrator(cfg)
            freeze_heap()
            asyncio.run(orch.run())
    except UserCodeError as e:  # the user's to fix: said in one line, and the driver does not restart
        print(f"prl: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    print(f"orchestrator: shipped steps {orch.start_step}..{cfg.rl.max_steps - 1}", flush=True)
