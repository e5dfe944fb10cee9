"""What a process keeps for the one run it runs: a run asks for its task and setup many
times, and a Hydra multirun's jobs share a process (the basic launcher, a joblib worker)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["RunSlot"]


class RunSlot(Generic[T]):
    """The value made for one run's key. Another key's value is let go before the new one
    is made, so a process never holds two runs' data at once (a room workload's task is
    ~165 MB; each job of a sweep kept its own until joblib retired the worker). Threads
    asking at once get the one value, made once."""

    def __init__(self) -> None:
        self._key: str | None = None
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self, key: str, make: Callable[[], T]) -> T:
        """The value for `key`, made by `make` on the first call with it."""
        with self._lock:
            if self._key != key or self._value is None:
                self._key, self._value = None, None  # the last run's value goes first
                self._value, self._key = make(), key
            return self._value
