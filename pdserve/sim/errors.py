"""Errors of the simulator (kept out of ``cluster.py``: mypyc cannot compile a subclass of a builtin
exception, and ``cluster.py`` is compiled by ``sim/accel.py``)."""


class SimulationStalled(RuntimeError):
    """An offline run ran out of events with turns still open: something waits for what never comes."""


class TurnDoesNotFit(ValueError):
    """A turn needs more KV pages than a decode engine has in all: the model's KV budget per decode GPU
    (``cost_model.hbm_kv_bytes``) is too small for the workload's contexts; no schedule can place it."""


class SimulationTooLarge(ValueError):
    """The run's workload has more turns than this machine's free memory can simulate (the estimate,
    ``MEMORY_BYTES_PER_TURN`` of ``sim/scenarios.py``, and what is free are in the message)."""
