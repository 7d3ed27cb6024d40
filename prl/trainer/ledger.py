"""The ledger of trained steps: `trained.jsonl` in the run directory of trainer rank 0.

One line per RL step the model's lineage has trained, `{"step", "prompts"}` (the data indices of
the step's groups), appended once the step's weights version is handed to publishing (sealed then, or
in the background while the next step trains: `trainer.publish_overlap`). A trainer restarted after a
fault resumes from its newest checkpoint and *replays* the steps after it from the batches kept in
its inbox (same batches, same order): a step already in the ledger is replayed, not trained anew,
so it is not logged again, and its version is published again only where it was never sealed. Every prompt index therefore appears in the ledger
at most once, which the fault-injection tests check.
"""

from __future__ import annotations

import json
from pathlib import Path

from prl.metrics import append_lines

LEDGER = "trained.jsonl"


def read_ledger(run_dir: Path) -> dict[int, list[int]]:
    path = Path(run_dir) / LEDGER
    if not path.is_file():
        return {}
    steps = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash mid-write: that step was not recorded
            continue
        steps[entry["step"]] = entry["prompts"]
    return steps


def record(run_dir: Path, step: int, prompts: list[int]) -> None:
    append_lines(Path(run_dir) / LEDGER, (json.dumps({"step": step, "prompts": prompts}) + "\n").encode())


def truncate(run_dir: Path, before: int) -> None:
    """Forget steps from `before` on (a resume by hand drops what followed its checkpoint)."""
    path = Path(run_dir) / LEDGER
    if path.is_file():
        kept = [json.dumps({"step": s, "prompts": p}) + "\n" for s, p in sorted(read_ledger(run_dir).items()) if s < before]
        tmp = path.with_name(LEDGER + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
