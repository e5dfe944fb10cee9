"""The run machinery: from a Hydra config to a finished, resumable run folder.

The `fl-run` entry point (`cli`, also `python -m fl.run`), the run's own top-level keys
(`settings`), overrides of keys the config lacks, refused before Hydra's dump
(`override_keys`), the dispatch of every config group's check (`validation`) and the apps it
runs, loaded by reference (`apps`); the engines that run the ServerApp and ClientApp they
are handed (`engines`); the round loops and the real arrival order (`loops`, `arrivals`);
injected faults and attacks (`faults`, `attacks`); checkpoints and forks (`checkpoint`);
metrics files, W&B and the console (`tracking`, `console`); plots and multirun
comparisons (`plots`, `compare`); a sweep's bookkeeping under any Hydra launcher (`sweep`)
and equal-budget tuning of a preset's arms (`tune`).
This is the top floor: it may import every other floor of `fl`, and none imports it.
"""

__all__ = ["latest_run", "main"]


def __getattr__(name: str) -> object:
    """`fl.run.main` and `fl.run.latest_run`, as before `fl.run` became a package, without
    importing Hydra for every module of this package."""
    if name in __all__:
        from fl.run import cli

        return getattr(cli, name)
    raise AttributeError(f"module 'fl.run' has no attribute {name!r}")
