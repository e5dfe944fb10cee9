"""The ground floor: what every other floor may use and which imports none of them.

User-facing errors (`errors`), seeds derived from positions and pinned torch threads
(`seeding`), the allow-list of classes a checkpoint may hold (`checkpointable`), the guard
against shadowed package names (`packaging`), and the run's configuration as every
process reads it, with the rules its checks are written in (`config`).
"""
