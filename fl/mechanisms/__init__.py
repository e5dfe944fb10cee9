"""The mechanisms strategies compose: pure functions and small stateful pieces.

Diagnoses of how the model moves (`diagnosis`), FedSU's speculation (`speculation`), the
actions a diagnosis drives and the laws that turn a value into an action (`actions`,
`laws`), LB-BSP's batch sizing (`lbbsp`), round-robin group schedules (`roundrobin`),
a SAC-Discrete agent (`sac`) and robust aggregation rules (`robust`). A mechanic used by
two strategies lives here once; no strategy lives here.
"""
