"""Real arrivals: replies in the order they reach the server, on the wall clock.

The loop's `arrival=real` order (the default on `engine=deployment`): instructions go out
with `Grid.push_messages` and replies are pulled as they land, with wall-clock deadlines.
The virtual order needs none of this; the clock decides there (`fl.run.loops`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping

from flwr.app import Message
from flwr.serverapp import Grid

__all__ = ["RealArrivals"]


class RealArrivals:
    """Replies in the order they reach the server, timed in wall seconds since training began.

    Instructions go out with `Grid.push_messages`; `next_arrival` polls
    `Grid.pull_messages` for the ones still out until one lands or `until` passes. Replies
    pulled together are taken in partition order, the only order they have.
    """

    POLL_S = 0.05

    def __init__(
        self,
        grid: Grid,
        partitions: Mapping[int, int],
        started_s: float = 0.0,
        *,
        timer: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`started_s`: time already trained (a resumed run); `timer`/`sleep`: the wall
        clock, replaceable so a test can drive arrivals without waiting for them."""
        self.grid = grid
        self.partitions = partitions
        self._timer, self._sleep = timer, sleep
        self._t0 = timer() - started_s
        self._out: dict[int, str] = {}  # node -> id of the instruction it is answering
        self._ready: deque[tuple[int, Message, float]] = deque()

    @property
    def now(self) -> float:
        return self._timer() - self._t0

    def push(self, messages: list[Message]) -> None:
        """Send `messages`; their replies are pulled by `next_arrival`."""
        ids = list(self.grid.push_messages(messages))
        for message, message_id in zip(messages, ids, strict=True):
            self._out[message.metadata.dst_node_id] = message_id

    def next_arrival(self, until: float) -> tuple[int, Message, float] | None:
        """The next reply to land as (node, reply, wall seconds), or None by `until`."""
        while not self._ready:
            if not self._out or self.now >= until:
                return None
            replies = list(self.grid.pull_messages(list(self._out.values())))
            landed_s = self.now
            for reply in sorted(replies, key=self._partition):
                node = reply.metadata.src_node_id
                if self._out.get(node) not in (None, reply.metadata.reply_to_message_id):
                    continue  # an answer to an instruction we no longer wait for
                if self._out.pop(node, None) is not None:
                    self._ready.append((node, reply, landed_s))
            if not self._ready:
                self._sleep(max(min(self.POLL_S, until - self.now), 0.0))
        return self._ready.popleft()

    def cancel(self, node: int) -> None:
        """Stop waiting for `node`: a reply it still sends is never pulled."""
        self._out.pop(node, None)
        self._ready = deque(r for r in self._ready if r[0] != node)

    def _partition(self, reply: Message) -> int:
        return self.partitions.get(reply.metadata.src_node_id, -1)
