"""The two surfaces of a server half: what an algorithm overrides, and the kernel's own.

`ALGORITHM_HOOKS` are the methods a strategy may override (docs/STRATEGIES.md shows each
with an example); `KERNEL_METHODS` are the plumbing that the round loop and the privacy
wrappers call, which keep every reply checked, every byte counted and every checkpoint in
one format. `refuse_kernel_overrides` holds a subclass to that when its class is created.
"""

from __future__ import annotations

__all__ = ["ALGORITHM_HOOKS", "INSTEAD", "KERNEL_METHODS", "refuse_kernel_overrides"]

# What an algorithm overrides: who trains, what each is sent, how a reply is read and
# checked, how replies become the new model, what is logged and saved, and, for the
# strategies whose gains are in time, how replies land on the clock.
ALGORITHM_HOOKS = (
    "select",
    "train_config",
    "train_payload",
    "sync_specs",
    "synced",
    "decode_reply",
    "check_update",
    "rebase",
    "aggregate",
    "on_round_start",
    "on_round_end",
    "another_exchange",
    "arrivals_to_close",
    "reserve_arrivals",
    "resync",
    "group_schedule",
    "upload_parts",
    "reply_parts",
    "diagnostics",
    "state_dict",
    "load_state_dict",
)
# Kernel plumbing: the round loop's and the wrappers' calls; final, never overridden.
KERNEL_METHODS = (
    "attach",
    "plan",
    "expect",
    "base_of",
    "bound_examples",
    "configure_train",
    "payload_limit",
    "check_reply",
    "accept",
    "give_up",
    "aggregate_train",
)
# the hook to write instead of each kernel method a subclass might reach for
INSTEAD = {
    "configure_train": "select, train_config, train_payload or on_round_start",
    "check_reply": "check_update",
    "accept": "check_update",
    "aggregate_train": "aggregate",
}


def refuse_kernel_overrides(cls: type) -> None:
    """TypeError if `cls` itself defines a kernel method, naming the hook to write instead."""
    for name in KERNEL_METHODS:
        if name in vars(cls):
            hook = INSTEAD.get(name, f"one of {', '.join(ALGORITHM_HOOKS)}")
            raise TypeError(
                f"{cls.__qualname__} overrides {name}, which is kernel plumbing "
                f"(fl.strategy.server.KERNEL_METHODS); override {hook} instead"
            )
