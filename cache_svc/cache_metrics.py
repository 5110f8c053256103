"""The cache's Prometheus metrics: its holdings read from the index when scraped, park and restore times,
checksum failures and evictions counted where the cache server meets them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from protos.auth import DEFAULT_TENANT

# seconds: a few MiB on a local disk to a long conversation's gigabytes
TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry, index) -> None:
        self.snapshots = Gauge(
            "deltaserve_cache_snapshots", "snapshots held (every tenant's)", registry=registry
        )
        self.bytes = Gauge("deltaserve_cache_bytes", "bytes of the snapshots held", registry=registry)
        self.snapshots.set_function(lambda: index.stat(DEFAULT_TENANT).count)
        self.bytes.set_function(lambda: index.stat(DEFAULT_TENANT).size_bytes)
        self.park_seconds = Histogram(
            "deltaserve_cache_park_seconds",
            "seconds of a stored Put, from its first message to its commit",
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self.restore_seconds = Histogram(
            "deltaserve_cache_restore_seconds",
            "seconds of a whole Get, from the request to its last chunk sent",
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self.checksum_failures = Counter(
            "deltaserve_cache_checksum_failures",
            "snapshots refused on a read for a failed checksum or a truncated blob (then quarantined)",
            registry=registry,
        )
        self.evictions = Counter(
            "deltaserve_cache_evictions",
            "snapshots evicted to make room under the budgets",
            registry=registry,
        )
