"""Weights & Biases logging (`[run] wandb`): the driver folds the run's event log into one W&B run.

Every process already writes its metrics to `metrics.jsonl`; the driver reads that file as the
dashboard does and logs one row per RL step: the orchestrator's `orch_step` fields as
`orchestrator/*`, the trainer's `trainer_step` fields as `trainer/*`, the servers' throughput as
`inference/*`, and the restart count as `faults/restarts`, all against the step metric `rl_step`.
A row is logged once the trainer has trained its step (the orchestrator runs ahead; its rows wait),
so W&B's rows are in step order and whole. SFT warm-start steps go to `sft/*` against `sft/step`.
Each eval is logged as it arrives, as `eval/<set>/<figure>` against `eval/step` (the step it was scheduled at).
The recipe is the run's config. The W&B run id is kept in `wandb.json` so `prl run --resume`
continues the same W&B run.

Nothing here is imported unless the recipe asks for W&B: `wandb` is an optional package.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import secrets
from pathlib import Path
from urllib.parse import urlparse

from prl.metrics import read_events
from prl.orchestrator.samples import STEPS_FILE
from prl.recipe.load import RecipeError
from prl.recipe.schema import Recipe
from prl.tui.evals import eval_record

NAMESPACES = {"orch_step": "orchestrator", "trainer_step": "trainer"}
SKIP = {"t", "step", "total"}  # bookkeeping, not metrics
SAMPLE_COLUMNS = ("step", "prompt_index", "prompt", "completion", "reward", "advantage")  # the `samples` table


class WandbError(RecipeError):
    pass


def check_wandb(recipe: Recipe) -> None:
    """Before launch: the package imports and, online, a login exists (as `wandb login` leaves it)."""
    cfg = recipe.run.wandb
    if cfg is None:
        return
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise WandbError(f"run.wandb: the `wandb` package is not importable ({e}); install it with "
                         "`pip install wandb` or remove [run] wandb") from None
    if cfg.mode == "online" and not logged_in():
        raise WandbError("run.wandb: mode 'online' needs a W&B login: run `wandb login`, set WANDB_API_KEY, "
                         "or set run.wandb.mode = 'offline' (sync later with `wandb sync`)")


def logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC", str(Path.home() / ".netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class WandbSink:
    """One W&B run fed from `metrics.jsonl`; `poll` after each look at the log, `close` at the end."""

    def __init__(self, recipe: Recipe, run_dir: Path, resume: bool):
        try:
            import wandb
        except ImportError as e:
            raise WandbError(f"run.wandb: the `wandb` package is not importable ({e}); `pip install wandb`") from None
        cfg = recipe.run.wandb
        self.id_file = run_dir / "wandb.json"
        before = json.loads(self.id_file.read_text()) if resume and self.id_file.exists() else {}
        run_id = before.get("id") or secrets.token_hex(4)
        self.ident = {"id": run_id, "project": cfg.project, "entity": cfg.entity}
        self.id_file.write_text(json.dumps({**self.ident, "logged": before.get("logged", -1)}))
        try:
            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=cfg.name or recipe.run.name, group=cfg.group,
                tags=cfg.tags or None, mode=cfg.mode, id=run_id, resume="allow", dir=str(run_dir),
                config=recipe.model_dump(mode="json"), settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as e:  # wandb raises its own errors (no network, bad entity, ...)
            raise WandbError(f"run.wandb: could not start the W&B run: {type(e).__name__}: {e}") from None
        for prefix in ("orchestrator", "trainer", "inference", "faults"):
            self.run.define_metric(f"{prefix}/*", step_metric="rl_step")
        self.run.define_metric("sft/*", step_metric="sft/step")
        # Evals get their own step metric and are logged on arrival: an eval of step N finishes after
        # the trainer's row N was logged (it runs beside training), so it cannot join that row, and
        # logging it with `rl_step` would send rl_step backwards. W&B's own `_step` only counts rows.
        self.run.define_metric("eval/*", step_metric="eval/step")
        self.metrics = run_dir / "metrics.jsonl"
        self.offset = self.metrics.stat().st_size if self.metrics.exists() else 0  # resumed: logged before
        self.rows: dict[int, dict] = {}
        self.logged = before.get("logged", -1)  # the last RL step logged (a resumed run re-trains some: not twice)
        self.failed = False
        self.training = 0  # the step being trained: servers' reports land in its row
        self.servers: dict[str, float] = {}
        self.restarts = 0
        self.evals: set[tuple[str, int]] = set()  # (set, step) logged: an eval replayed is not logged twice
        self.samples = run_dir / "samples" / STEPS_FILE  # what the model wrote: a table in each RL row
        self.samples_offset = self.samples.stat().st_size if resume and self.samples.exists() else 0

    def poll(self) -> None:
        """Log what arrived. A W&B failure never stops training: it is reported once, then W&B is off."""
        if self.failed:
            return
        try:
            events, self.offset = read_events(self.metrics, self.offset)
            for e in events:
                self.add(e)
        except Exception as e:  # noqa: BLE001 - whatever wandb raises
            self.fail(e)

    def fail(self, e: Exception) -> None:
        import sys

        self.failed = True
        print(f"prl run: W&B logging stopped ({type(e).__name__}: {e}); the run goes on", file=sys.stderr)

    def add(self, e: dict) -> None:
        kind = e.get("kind")
        if kind == "trainer_step" and e.get("stage") == "sft":
            self.run.log({"sft/step": e["step"], **fields(e, "sft")})
        elif kind in NAMESPACES and isinstance(e.get("step"), int) and e["step"] > self.logged:
            self.rows.setdefault(e["step"], {}).update(fields(e, NAMESPACES[kind]))
            if kind == "trainer_step":
                self.training = e["step"] + 1
                self.flush(e["step"])
        elif kind == "server" and numeric(e.get("tokens_per_s")):
            self.servers[e.get("name", "?")] = e["tokens_per_s"]
            row = self.rows.setdefault(self.training, {})
            row["inference/tokens_per_s"] = sum(self.servers.values())
            row.update({f"inference/{n}/tokens_per_s": v for n, v in self.servers.items()})
        elif kind == "restart":
            self.restarts += 1
            self.rows.setdefault(self.training, {})["faults/restarts"] = self.restarts
        elif kind == "eval":
            self.log_eval(e)

    def log_eval(self, e: dict) -> None:
        r = eval_record(e)
        if r is None or (r["set"], r["step"]) in self.evals:
            return
        self.evals.add((r["set"], r["step"]))
        self.run.log({"eval/step": r["step"], **{f"eval/{r['set']}/{k}": v for k, v in r["figures"].items()}})

    def flush(self, upto: int | None = None) -> None:
        for step in sorted(s for s in self.rows if upto is None or s <= upto):
            row = self.rows.pop(step)
            if not any(k.startswith(("orchestrator/", "trainer/")) for k in row):
                if upto is not None:  # server/restart values before the step's own: carried to the next row
                    self.rows[step + 1] = {**row, **self.rows.get(step + 1, {})}
                continue
            if step > self.logged:
                self.run.log({"rl_step": step, **row, **self.new_samples()})
                self.logged = step
        self.id_file.write_text(json.dumps({**self.ident, "logged": self.logged}))

    def new_samples(self) -> dict:
        """The samples written since the last row (`run.samples_per_step` a step), as a W&B table."""
        import wandb

        kept, self.samples_offset = read_events(self.samples, self.samples_offset)  # whole lines: one being written waits
        rows = [[s.get(c) for c in SAMPLE_COLUMNS] for s in kept]
        return {"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)} if rows else {}

    def close(self, state: str, code: int) -> None:
        self.poll()
        try:
            if not self.failed:
                self.flush()
                self.run.summary["prl/state"] = state
            self.run.finish(exit_code=code)
        except Exception as e:  # noqa: BLE001 - the run's outcome stands whatever W&B does
            self.fail(e)


def fields(e: dict, prefix: str) -> dict:
    return {f"{prefix}/{k}": v for k, v in e.items() if k not in SKIP and numeric(v)}
