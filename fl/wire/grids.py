"""A Grid that wraps another: every call goes to `inner` unless a subclass changes it.

Our wrappers (a ServerApp's node allow-list, the bulk side channel) override only the
calls they change; the rest of Flower's Grid interface lives here once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

__all__ = ["DelegatingGrid"]


class DelegatingGrid(Grid):
    """`inner` with nothing changed; subclasses override what they wrap."""

    def __init__(self, grid: Grid) -> None:
        self.inner = grid

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def get_nodes(self) -> Any:
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.inner.send_and_receive(messages, timeout=timeout)

    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def create_message(  # deprecated in flwr, abstract all the same
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)
