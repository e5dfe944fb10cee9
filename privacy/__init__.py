"""Privacy: DP-SGD clients through Opacus, Flower's central DP, DPBalance budget scheduling.

Modules: `dpsgd` (client-side DP-SGD and accounting), `rounds` (the server's per-round
ε bookkeeping and ledger charges), `central` (Flower's server-side DP wrappers),
`dpbalance` (the schedulers), `ledger` (the SQLite budget ledger) and `ledger_schema`
(its tables, constraints and invariants), `simulation` and `cli` (the scheduling study).
Nothing heavy is imported here; see docs/PRIVACY.md.
"""

__all__: list[str] = []
