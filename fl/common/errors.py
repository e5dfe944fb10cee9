"""Errors a user can fix: `fl-run` prints them as one line and exits non-zero."""

from __future__ import annotations

__all__ = ["RunError"]


class RunError(Exception):
    """A run that cannot start or continue, for a reason the message states in one line."""
