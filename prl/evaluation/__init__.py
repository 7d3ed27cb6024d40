"""Held-out evaluation: an eval set is an environment run without training (`[eval.<name>]`).

`estimators`: pass@k, best@k and maj@k from the samples of each example; `sets`: an eval set built
from the recipe (its environment, examples and held-out indices); `runner`: the set through a
sampler, scored; the orchestrator schedules sets inside a run (`prl.orchestrator.evals`) and
`prl eval` runs them on a checkpoint or a model folder (`prl.launch.evaluate`)."""
