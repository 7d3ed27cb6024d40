"""The embedded engine (`prl.inference`, prl's own server on Hugging Face model classes): the default
backend. Everything it needs is the registry's defaults."""

from __future__ import annotations

from prl.backends.spec import BackendSpec


class EmbeddedSpec(BackendSpec):
    def make_client(self, base_url: str, secret: str, max_connections: int = 128, **options):
        from prl.backends.embedded import EmbeddedBackend

        return EmbeddedBackend(base_url, secret, max_connections)  # it needs no options (EOS is the server's)


SPEC = EmbeddedSpec(name="embedded", client="prl.backends.embedded:EmbeddedBackend")
