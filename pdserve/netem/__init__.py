"""Node network emulation: shared, prioritized, rate-limited NIC links on one machine.

`SharedLink` (link.py) is one fluid weighted-fair link whose state is shared by all processes through a
small mmap'ed file; `TrafficManager` (traffic.py) gives an engine process its node's storage NIC and its
own compute NIC. Budgets of `math.inf` (the default) turn emulation off at zero cost.
"""

from pdserve.netem.link import (
    TAG_OTHER,
    TAG_READ,
    TAG_TRANSFER,
    TAG_WRITE,
    LinkConfigError,
    LinkFullError,
    LinkIntegrityError,
    SharedLink,
    TrafficClass,
    transmit_all,
)
from pdserve.netem.traffic import Flow, NodeConfig, TrafficManager

__all__ = [
    "TAG_OTHER",
    "TAG_READ",
    "TAG_TRANSFER",
    "TAG_WRITE",
    "Flow",
    "LinkConfigError",
    "LinkFullError",
    "LinkIntegrityError",
    "NodeConfig",
    "SharedLink",
    "TrafficClass",
    "TrafficManager",
    "transmit_all",
]
