"""Errors of the simulator (kept out of ``cluster.py``: mypyc cannot compile a subclass of a builtin
exception, and ``cluster.py`` is compiled by ``sim/accel.py``)."""


class SimulationStalled(RuntimeError):
    """An offline run ran out of events with turns still open: something waits for what never comes."""
