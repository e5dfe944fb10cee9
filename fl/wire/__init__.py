"""The wire: how models and replies are laid out, encoded and kept in step.

A model as one flat vector and Flower records without extra copies (`records`); payload
codecs with honest byte accounting (`codec`); bit-packing and masks (`packing`,
`masking`); the one protocol that sends each client the changes since what it last saw
(`sync`); the streamed float64 mean of many replies (`streaming`, its compiled kernel
`mean_kernel`); the strategy/contract stamp of every instruction (`contract`); and the
Grid wrapper our grids build on (`grids`).
Nothing here knows about clients, time or strategies.
"""
