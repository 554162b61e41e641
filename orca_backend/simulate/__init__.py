"""A serving simulator (in progress): the engine's own scheduler in virtual time (`loop`),
its iterations timed by a cost model of the hardware (`cost_model`, `hardware`). Torch-free."""
