"""The backend registry: every inference backend prl can drive, one `BackendSpec` each.

A backend is one module (or folder) under `prl/backends/` plus one line in `SPECS` below. The spec is
what the rest of prl asks instead of comparing `inference.backend` with a name:

- the recipe checks (`prl.launch.checks`): `check_recipe` (what the backend refuses at validation,
  naming the key), `owned_args` (arguments prl sets itself), `not_built` (valid settings `prl run`
  refuses);
- the driver (`prl.launch.driver`): `preflight` (what it cannot do on this machine, with the reason);
- the process plan (`prl.launch.processes`): `launch_command` (None: prl's own `python -m prl.inference`);
- the orchestrator: `make_client` (its `InferenceBackend`);
- the trainer: `publish_format` ("memory": the model's own names, "hf": Hugging Face checkpoint names);
- `prl doctor`: `host_packages` (what its hosts must import).

This module and the spec modules (each a `BackendSpec`, `prl.backends.spec`) import nothing heavy (no
torch, no httpx, nothing from prl but the spec class at module level): the launch's recipe checks
(`prl.launch.checks`) load them. A spec's methods import what they run when called.
"""

from __future__ import annotations

import importlib

from prl.backends.spec import BackendSpec

# name -> "module:attribute" of its spec, loaded on first use
SPECS = {
    "embedded": "prl.backends.embedded_spec:SPEC",
    "vllm": "prl.backends.vllm.spec:SPEC",
}


def names() -> list[str]:
    return list(SPECS)


def get(name: str) -> BackendSpec:
    if name not in SPECS:
        raise ValueError(f"inference.backend = {name!r}: unknown backend (registered: {', '.join(SPECS)})")
    module, _, attr = SPECS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def make_backend(kind: str, base_url: str, secret: str, max_connections: int = 128, **options):
    """A client for one server of backend `kind` (`prl.backends.base.InferenceBackend`)."""
    return get(kind).make_client(base_url, secret, max_connections, **options)
