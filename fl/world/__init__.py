"""The simulated world: the devices, networks, data and models a run trains on.

The event-driven virtual clock with a shared server link (`clock`), the device profiles
and the traces of speed and availability it reads (`devices`, `traces`),
the population of node ids and partitions (`population`), datasets, procedural data and
partitioners (`data`, `procedural`, `partition`), model builders (`models`), and the task
that ties a dataset, a partition and a model together (`task`). Real training decides
accuracy; this floor decides everything else a client's round is made of.
"""
