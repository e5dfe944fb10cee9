"""The ServerApp and ClientApp a run runs, named by reference the way Flower names them.

`server.app:app` and `clients.app:app` are the references pyproject's
`[tool.flwr.app.components]` gives `flwr run`; fl-run loads them here and hands them to
the engine it starts, so no engine, and nothing else in `fl`, imports `server/` or
`clients/`. Another pair of apps runs on the same engines by passing their references.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

__all__ = [
    "CLIENT_APP",
    "SERVER_APP",
    "Apps",
    "CohortClientApp",
    "CohortReplies",
    "CohortTrain",
    "load_app",
]

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


@dataclass(frozen=True)
class CohortReplies:
    """What a cohort call did with each message, in order: its reply, the exception that
    stopped it (the engine replies with an error, as for one client), or None where it
    left the message to the per-client path (touching nothing of its node); `path` says,
    in words, which path the messages took and why. `batch`: the content of the one
    reply (`fl.wire.cohort_reply`) answering the messages at positions `in_batch` (their
    `replies` entries stay None), where the engine asked for it."""

    replies: list[Message | BaseException | None]
    path: str
    batch: RecordDict | None = None
    in_batch: list[int] = field(default_factory=list)


# Train messages with their nodes' Contexts -> what became of each; an engine whose server
# takes cohort replies passes a second argument, True: one reply may answer the members.
CohortTrain = Callable[..., CohortReplies]


class CohortClientApp(ClientApp):
    """A ClientApp that may also train several nodes' train instructions in one call.

    An engine that holds many clients in one process (`local`) hands such an app the
    train messages of a pull together, as `(message, context)` pairs; the app decides
    which of them it can train as one cohort and leaves the rest to its ordinary
    per-message path (mods included). Any other engine sees an ordinary ClientApp.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.cohort_train: CohortTrain | None = None

    def cohort(self) -> Callable[[CohortTrain], CohortTrain]:
        """Decorator registering the cohort trainer (as `@app.train()` registers train)."""

        def register(function: CohortTrain) -> CohortTrain:
            self.cohort_train = function
            return function

        return register
