"""The cache service's settings, checked where they are made."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(slots=True)
class CacheServiceConfig:
    root_dir: str  # where snapshots live (created when missing)
    budget_bytes: int  # least recently used unpinned snapshots are evicted beyond it
    tenant_budget_bytes: int | None = None  # each tenant's share (a put evicts its own tenant's only)

    def __post_init__(self) -> None:
        if not self.root_dir:
            raise ValueError("the cache directory must not be empty")
        self.root_dir = os.path.abspath(os.path.expanduser(self.root_dir))
        if self.budget_bytes < 1:
            raise ValueError(f"the cache budget must be at least one byte, got {self.budget_bytes}")
