"""The strategy contract: what an algorithm writes, and how the runtime finds it.

A strategy is a server half (`server.ServerStrategy`, Flower's FedAvg with per-node
messages, checked replies and resume), a client half (`client.ClientHooks`, answering at
the trainer's hook points) and a params dataclass, registered by name (`registry`).
docs/STRATEGIES.md lists the methods an algorithm overrides, with one example each.
"""

from fl.strategy.server import ClientUpdate, ReplyInfo, RoundStats, ServerStrategy, UploadParts

__all__ = ["ClientUpdate", "ReplyInfo", "RoundStats", "ServerStrategy", "UploadParts"]
