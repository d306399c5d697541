"""Data plane for PD disaggregation: page lists -> descriptors (`pages`), staging for fragmented
lists (`staging`), backends behind one interface (`base`: "nixl", "fake"), and the single thread that
owns a backend (`agent`). Importing this package does not import NIXL or torch."""

from pdserve.transfer.base import (
    BACKENDS,
    DEFAULT_BACKEND,
    TransferBackend,
    TransferError,
    TransferStatus,
    create_backend,
)
from pdserve.transfer.pages import (
    DEFAULT_FRAGMENTATION_THRESHOLD,
    RegionTable,
    is_fragmented,
    merge_runs,
    page_descriptors,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "DEFAULT_FRAGMENTATION_THRESHOLD",
    "RegionTable",
    "TransferBackend",
    "TransferError",
    "TransferStatus",
    "create_backend",
    "is_fragmented",
    "merge_runs",
    "page_descriptors",
]
