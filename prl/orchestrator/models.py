"""The clients of the models a run serves beside its policy, whose weights never change: a teacher
(`prl.orchestrator.teacher`), a reward model and an LLM judge (`prl.orchestrator.rewards`), each over
`prl.orchestrator.frozen.FrozenServers`."""

from __future__ import annotations

from collections.abc import Callable

from prl.backends import registry
from prl.orchestrator.frozen import FrozenServers


class ModelClients:
    def __init__(self, cfg, tokenizer, log, locator: Callable[[str, str], Callable[[], str] | None]):
        self.cfg, self.tokenizer, self.log, self.locator = cfg, tokenizer, log, locator  # cfg: OrchestratorConfig
        self.connections = cfg.rl.max_inflight_rollouts + 8

    def frozen(self, kind: str, urls: list[str], backends: list | None = None) -> FrozenServers:
        """Servers the run serves, `kind-N` each: prl's own API at `urls`, or the given `backends`; a hung one is
        reported (`unresponsive`), and the driver restarts it."""
        from prl.backends.embedded import EmbeddedBackend

        if backends is None:
            backends = [EmbeddedBackend(url, self.cfg.secret(), self.connections) for url in urls]
        for i, (client, url) in enumerate(zip(backends, urls)):
            client.locate = self.locator(f"{kind}-{i}", url)
        hang = self.cfg.run.hang_timeout_s
        return FrozenServers(kind, backends, retry_s=max(self.cfg.startup_timeout_s, 3 * hang), hang_s=hang,
                             on_hang=lambda i, cause: self.log.emit("unresponsive", name=f"{kind}-{i}", cause=cause))

    def teacher(self):
        """On-policy distillation: the teacher's servers, of the run's inference backend (None without a teacher)."""
        if self.cfg.teacher is None:
            return None
        from prl.orchestrator.teacher import Teacher

        spec, secret = registry.get(self.cfg.backend), self.cfg.secret()
        clients = [spec.make_client(url, secret, self.connections, **spec.client_options(self.tokenizer, self.cfg))
                   for url in self.cfg.teachers]
        return Teacher(self.cfg.teacher, self.frozen("teacher", self.cfg.teachers, clients))

    def rewards(self):
        """`[reward.model]`, `[reward.judge]`: the models a group's rewards come from (None without them)."""
        cfg = self.cfg.reward
        if cfg.model is None and cfg.judge is None:
            return None
        from prl.orchestrator.rewards import ModelRewards

        scorer = self.frozen("reward-model", self.cfg.reward_models) if cfg.model is not None else None
        return ModelRewards(cfg, self.tokenizer, scorer, self.judge())

    def judge(self):
        judge = self.cfg.reward.judge
        if judge is None:
            return None
        from prl.orchestrator.judge import Judge, judge_servers
        from prl.tasks import import_function

        parse = import_function(judge.parser, "reward.judge.parser") if judge.parser else None
        chats = judge_servers(judge, self.cfg.judges, self.cfg.secret())
        if self.cfg.judges:  # served by the run: hung past run.hang_timeout_s, as its other servers
            servers = self.frozen("judge", self.cfg.judges, chats)
        else:  # outside: nothing to restart, three timeouts
            servers = FrozenServers("judge", chats, retry_s=3 * judge.timeout_s, hang_s=judge.timeout_s)
        return Judge(judge, servers, parse)
