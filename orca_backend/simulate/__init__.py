"""The serving simulator: the engine's own scheduler in virtual time (`loop`), its iterations
timed by a cost model of the hardware (`cost_model`, `hardware`, fitted by `calibrate`), over
the load generator's seeded traces (`traces`), swept over request rates (`sweep`).
`python -m orca_backend.simulate` is the command. Torch-free."""
