"""Planner settings, checked where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PlannerConfig:
    # Executor addresses (host:port). Empty with an in-process link.
    executors: list[str] = field(default_factory=list)
    # Tokenizer source: same meaning as ExecutorConfig.model (None = the SmolLM2 GGUF).
    model: str | None = None
    prefill_token_budget: int = 2048  # prompt tokens read per step (chunked prefill)
    max_waiting: int = 1024  # queued requests before Generate answers RESOURCE_EXHAUSTED
    inflight_plans: int = 2  # plans in flight per executor: the step running and the next
    row_check: bool = False  # ship the mirror of every row read, for the executor to compare
    prefix_cache: bool = True  # share full prompt pages across requests (hash chain of their tokens)
    cache: str | None = None  # the cache service (host:port) for parked conversations; None = no parking
    retention_cap: int = 6  # checkpoints kept per conversation
    retention_policy: str = "spread"  # spread | lru

    def __post_init__(self) -> None:
        if self.prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be positive, got {self.prefill_token_budget}")
        if self.inflight_plans not in (1, 2):
            raise ValueError(f"inflight_plans must be 1 or 2, got {self.inflight_plans}")
        if self.retention_cap < 1:
            raise ValueError(f"retention_cap must be positive, got {self.retention_cap}")
        if self.retention_policy not in ("spread", "lru"):
            raise ValueError(f"retention_policy must be spread or lru, got {self.retention_policy!r}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be positive, got {self.max_waiting}")
