"""Errors of the gradient transport; each names the peer's task and address."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Peer:
    """Another worker of the job, as the transport knows it.

    Attributes:
        rank: Its position in the transport's group (its TF_CONFIG training-task order).
        task: Its TF_CONFIG task, e.g. "worker:1".
        address: Where its transport listens, "host:port" (None before rendezvous).
    """

    rank: int
    task: str
    address: str | None = None

    def __str__(self) -> str:
        return f"{self.task} ({self.address})" if self.address else self.task


class TransportError(RuntimeError):
    """The gradient transport failed; the message says where and how to fix it."""


class PeerLostError(TransportError):
    """A peer died, closed its connection, or sent nothing for longer than the timeout.

    Attributes:
        peer: The peer that was lost (the first one a worker noticed).
    """

    def __init__(self, message: str, peer: Peer):
        super().__init__(message)
        self.peer = peer


class ProtocolError(TransportError):
    """A peer sent a malformed, truncated or unexpected frame."""


class AuthenticationError(TransportError):
    """A connection did not prove that it knows the job's secret."""
