"""The ServerApp and ClientApp a run runs, named by reference the way Flower names them.

`server.app:app` and `clients.app:app` are the references pyproject's
`[tool.flwr.app.components]` gives `flwr run`; fl-run loads them here and hands them to
the engine it starts, so no engine, and nothing else in `fl`, imports `server/` or
`clients/`. Another pair of apps runs on the same engines by passing their references.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

__all__ = ["CLIENT_APP", "SERVER_APP", "Apps", "load_app"]

SERVER_APP = "server.app:app"
CLIENT_APP = "clients.app:app"


def load_app(reference: str) -> object:
    """The object a `module:attribute` reference names."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Apps:
    """A ServerApp and a ClientApp, with the references a new process loads them by."""

    server: ServerApp
    client: ClientApp
    server_ref: str = SERVER_APP
    client_ref: str = CLIENT_APP

    @classmethod
    def load(cls, server_ref: str = SERVER_APP, client_ref: str = CLIENT_APP) -> Apps:
        """Import both apps by reference; a reference to something else is a TypeError."""
        server, client = load_app(server_ref), load_app(client_ref)
        if not isinstance(server, ServerApp) or not isinstance(client, ClientApp):
            raise TypeError(f"{server_ref} and {client_ref} must name a ServerApp and a ClientApp")
        return cls(server, client, server_ref, client_ref)
