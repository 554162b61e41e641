"""Torch-free bookkeeping: engine options, sampling parameters, requests, the K/V block
manager, the scheduler and the scheduler/runner messages. Everything else builds on these;
they import nothing of the package above them (and neither torch nor numpy)."""
