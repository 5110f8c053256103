"""The planner's Prometheus metrics: live state read at scrape time, each request's figures recorded as its
stream is written (the client-facing side, off the engine's step loop), and the requests Generate refuses
before admission, by status code (planner_svc/refusals.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from planner_svc.conversations import Mount
from planner_svc.requests import Request
from protos import client_pb2

# seconds: from a fast GPU step (a few ms) to a long CPU prefill
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
QUEUE_BUCKETS = (*LATENCY_BUCKETS, 60.0, 120.0, 300.0, 600.0)  # a backlog may hold a request for minutes
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
REUSE_SOURCES = ("checkpoint", "snapshot", "prefix")
# The codes Generate refuses a request with before admission, labelled from the start (any other code a
# refusal carries is one of gRPC's 17 names: the label set stays bounded).
REFUSED_CODES = (
    "RESOURCE_EXHAUSTED",
    "INVALID_ARGUMENT",
    "UNAVAILABLE",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "ALREADY_EXISTS",
    "NOT_FOUND",
    "FAILED_PRECONDITION",
)


def reuse_source(mount: Mount, reused: int) -> str | None:
    """Where a request's reused prompt tokens came from: its conversation's checkpoint in the pool, a
    snapshot restored from the cache, or pages shared with an identical prompt start."""
    if not reused:
        return None
    if mount.reused and mount.checkpoint.startswith("snapshot@"):
        return "snapshot"
    return "checkpoint" if mount.reused else "prefix"


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry)

        self.running = gauge("deltaserve_requests_running", "requests prefilling or decoding")
        self.waiting = gauge("deltaserve_requests_waiting", "requests queued for admission")
        self.pages_used = gauge("deltaserve_kv_pages_used", "KV pages held (requests, conversations, cache)")
        self.pages_total = gauge("deltaserve_kv_pages_total", "KV pages in the pools, the sink page aside")
        self.ttft = Histogram(
            "deltaserve_time_to_first_token_seconds",
            "from the request's arrival to its first token written to the client",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "deltaserve_inter_token_latency_seconds",
            "between consecutive tokens of a request (a message of n tokens: n gaps of gap / n)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "deltaserve_request_queue_time_seconds",
            "from the request's arrival to its admission (its pages given)",
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "deltaserve_request_duration_seconds",
            "from the request's arrival to its finish",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "deltaserve_prompt_tokens", "prompt tokens of finished requests", registry=registry
        )
        self.reused_tokens = Counter(
            "deltaserve_prompt_tokens_reused",
            "prompt tokens whose KV was reused, by source",
            ["source"],
            registry=registry,
        )
        for source in REUSE_SOURCES:
            self.reused_tokens.labels(source)
        self.generation_tokens = Counter(
            "deltaserve_generation_tokens", "tokens generated and sent", registry=registry
        )
        self.finished = Counter(
            "deltaserve_requests_finished", "requests ended, by finish reason", ["reason"], registry=registry
        )
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(reason)
        self.refused = Counter(
            "deltaserve_requests_refused",
            "requests refused before admission, by gRPC status code",
            ["code"],
            registry=registry,
        )
        for code in REFUSED_CODES:
            self.refused.labels(code)

    def follow(self, schedulers: Callable[[], Sequence]) -> None:
        """The live gauges, read from the schedulers when scraped."""
        self.running.set_function(lambda: sum(s.running for s in schedulers()))
        self.waiting.set_function(lambda: sum(len(s.waiting) for s in schedulers()))
        self.pages_total.set_function(lambda: sum(s.pages.total for s in schedulers()))
        self.pages_used.set_function(lambda: sum(s.pages.total - s.pages.free_count for s in schedulers()))

    def request(self) -> RequestClock:
        return RequestClock(self)


class RequestClock:
    """One request's timing, fed each response as it is written to the client."""

    def __init__(self, metrics: PlannerMetrics) -> None:
        self.metrics = metrics
        self.arrived = time.perf_counter()
        self.last: dict[
            int, float
        ] = {}  # by choice: n > 1 merges the choices' messages, a step's side by side

    def sent(self, response: client_pb2.GenerateResponse) -> None:
        n = len(response.token_ids) // 4
        if not n:
            return
        now = time.perf_counter()
        if not self.last:  # the request's first tokens
            self.metrics.ttft.observe(now - self.arrived)
        last = self.last.get(response.index)  # None: the choice's first tokens (the request's: the TTFT)
        if last is not None:
            gap = (now - last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.last[response.index] = now
        self.metrics.generation_tokens.inc(n)  # as sent: a long stream counts while it runs

    def ended(self, req: Request, mount: Mount, reason: str) -> None:
        """An admitted request's end. `reason`: stop | length | abort, or error for one that failed after
        admission (a request refused before admission never gets here: deltaserve_requests_refused_total)."""
        metrics = self.metrics
        metrics.duration.observe(time.perf_counter() - self.arrived)
        if req.admitted_at:  # an abort while it waited: never admitted
            metrics.queue_time.observe(req.admitted_at - self.arrived)
        metrics.finished.labels(reason).inc()
        metrics.prompt_tokens.inc(req.prompt_len)
        source = reuse_source(mount, req.reused)
        if source is not None:
            metrics.reused_tokens.labels(source).inc(req.reused)
