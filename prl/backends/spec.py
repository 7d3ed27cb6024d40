"""What a registered inference backend tells the rest of prl (`prl.backends.registry` lists them, one
spec module each): its client, launch command, publish format, owned arguments, recipe rules, preflight
refusals and doctor packages. Imports nothing heavy and nothing from prl at module level; a spec's
methods import what they run when called."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackendSpec:
    """Defaults are the embedded engine's: prl's own server process, memory names, no extra checks."""

    name: str
    client: str  # "module:Class" of its InferenceBackend
    publish_format: str = "memory"  # "memory" | "hf"
    owned_args: dict[str, str] = field(default_factory=dict)  # argument -> the recipe key that sets it
    host_packages: tuple[tuple[str, str], ...] = ()  # (import name, cluster.extras name) on its hosts
    # trainer.weight_transfer values its servers take ("collective", "stream": `prl.transport.collective`)
    weight_paths: tuple[str, ...] = ("folder", "collective", "stream")
    # its passthrough table [inference.NAME] (any other argument of the engine) is the field of
    # InferenceCfg named like the backend, when it has one

    def check_recipe(self, recipe) -> None:
        """Raise ValueError naming the key for a setting this backend can never serve (validation time)."""

    def not_built(self, recipe) -> list[str]:
        """Valid settings whose implementation for this backend does not exist yet."""
        path = recipe.trainer.weight_transfer
        if path not in self.weight_paths:
            return [f"trainer.weight_transfer = {path!r} with inference.backend = {self.name!r}: its servers' end of "
                    f"that path is not built yet (built: {', '.join(self.weight_paths)})"]
        return []

    def preflight(self, recipe, folder) -> str | None:
        """What this backend cannot do where the recipe's servers run (None: nothing). `folder`: the
        pretrained folder's facts read on this machine, or None."""
        return None

    def launch_command(self, cfg, python: str) -> list[str] | None:
        """The server's command line; None: `python -m prl.inference --config CFG`."""
        return None

    def client_options(self, tokenizer, cfg) -> dict:
        """Keyword arguments its client needs beyond url and secret (`cfg`: the orchestrator's config)."""
        return {}

    def make_client(self, base_url: str, secret: str, max_connections: int = 128, **options):
        module, _, cls = self.client.partition(":")
        return getattr(importlib.import_module(module), cls)(base_url, secret, max_connections, **options)
