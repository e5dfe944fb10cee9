"""The server's side of the bulk channel: blobs waiting for download, uploads received.

Every instruction the ServerApp sends through the side channel gets a fresh random
token. The token lets its node fetch the blobs published for it and upload one reply
blob of at most `max_upload_bytes`, one stream at a time; nothing else can be fetched or
stored. Downlink
blobs are kept once per content (every node receives the same global model) and freed
when no live token needs them; tokens expire after `ttl_s`.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

from fl.net.transport.digest import blob_digest

__all__ = ["BlobStore", "StoreError"]


class StoreError(Exception):
    """A request the store refuses (unknown token, size over the limit, bad checksum)."""


@dataclass
class _Ticket:
    """What one token allows, and the upload it brought."""

    expires: float
    downloads: set[str] = field(default_factory=set)  # sha256 of blobs it may fetch
    upload: bytearray | None = None
    upload_sha256: str = ""
    uploading: bool = False  # an upload stream is under way


class BlobStore:
    """Tokens, the blobs they may fetch, and the uploads they brought (thread-safe)."""

    def __init__(self, max_upload_bytes: int, ttl_s: float = 3600.0) -> None:
        self.max_upload_bytes = max_upload_bytes
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._tickets: dict[str, _Ticket] = {}
        self._blobs: dict[str, bytearray] = {}

    def issue(self) -> str:
        """A new token (and expired ones forgotten)."""
        token = secrets.token_hex(16)
        with self._lock:
            now = time.monotonic()
            for old in [t for t, ticket in self._tickets.items() if ticket.expires < now]:
                del self._tickets[old]
            self._tickets[token] = _Ticket(now + self.ttl_s)
            self._collect()
        return token

    def publish(self, token: str, sha256: str, blob: bytearray) -> None:
        """Let `token` fetch `blob` (whose SHA-256 the caller computed)."""
        with self._lock:
            self._ticket(token).downloads.add(sha256)
            self._blobs.setdefault(sha256, blob)

    def blob(self, token: str, sha256: str) -> bytearray:
        """A published blob `token` may fetch."""
        with self._lock:
            if sha256 not in self._ticket(token).downloads:
                raise StoreError("this token may not fetch that blob")
            return self._blobs[sha256]

    def live(self, token: str) -> bool:
        """Whether `token` is still valid (issued, not released, not expired)."""
        with self._lock:
            ticket = self._tickets.get(token)
            return ticket is not None and ticket.expires >= time.monotonic()

    def holds(self, sha256: str) -> bool:
        """Whether a live token still needs the blob `sha256`."""
        with self._lock:
            return sha256 in self._blobs

    def check_upload(self, token: str, nbytes: int) -> None:
        """Refuse an upload of `nbytes` before any byte arrives."""
        with self._lock:
            self._check_upload(self._ticket(token), nbytes)

    def _check_upload(self, ticket: _Ticket, nbytes: int) -> None:
        if ticket.upload is not None:
            raise StoreError("this token already uploaded its reply")
        if not 0 <= nbytes <= self.max_upload_bytes:
            raise StoreError(f"upload of {nbytes} B exceeds the limit of {self.max_upload_bytes} B")

    def begin_upload(self, token: str, nbytes: int) -> None:
        """Claim `token`'s one upload stream for `nbytes`; `end_upload` or `accept_upload`
        frees it. A second stream while one runs is refused: one token, one buffer."""
        with self._lock:
            ticket = self._ticket(token)
            self._check_upload(ticket, nbytes)
            if ticket.uploading:
                raise StoreError("an upload for this token is already under way")
            ticket.uploading = True

    def end_upload(self, token: str) -> None:
        """The upload stream of `token` ended without an accepted upload."""
        with self._lock:
            ticket = self._tickets.get(token)
            if ticket is not None:
                ticket.uploading = False

    def accept_upload(self, token: str, sha256: str, data: bytearray) -> None:
        """Keep a received upload if its SHA-256 is the one declared."""
        self.check_upload(token, len(data))
        if blob_digest(data) != sha256:
            raise StoreError("upload does not match its declared SHA-256")
        with self._lock:
            ticket = self._ticket(token)
            ticket.upload, ticket.upload_sha256, ticket.uploading = data, sha256, False

    def take_upload(self, token: str, sha256: str) -> bytearray:
        """The verified upload of `token` whose SHA-256 is `sha256`."""
        with self._lock:
            ticket = self._ticket(token)
            if ticket.upload is None or ticket.upload_sha256 != sha256:
                raise StoreError("no upload with that SHA-256 for this token")
            return ticket.upload

    def release(self, token: str) -> None:
        """Forget a token whose reply arrived (or was given up on); free unused blobs."""
        with self._lock:
            self._tickets.pop(token, None)
            self._collect()

    @property
    def held_bytes(self) -> int:
        """Bytes held in downlink blobs and uploads."""
        with self._lock:
            uploads = sum(len(t.upload) for t in self._tickets.values() if t.upload is not None)
            return sum(len(b) for b in self._blobs.values()) + uploads

    def _ticket(self, token: str) -> _Ticket:
        ticket = self._tickets.get(token)
        if ticket is None or ticket.expires < time.monotonic():
            raise StoreError("unknown or expired token")
        return ticket

    def _collect(self) -> None:
        wanted = set().union(*(t.downloads for t in self._tickets.values()))
        for sha in [s for s in self._blobs if s not in wanted]:
            del self._blobs[sha]
