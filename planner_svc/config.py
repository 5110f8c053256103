"""Planner settings, checked where they are made; each setting has one home (the scheduler's and the
retention's settings are theirs, nested here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner_svc.retention import RetentionConfig


@dataclass(slots=True)
class SchedulingConfig:
    """The planner's settings of every scheduler (carried by SchedulerConfig.settings)."""

    prefill_token_budget: int = 2048  # prompt tokens read per step (chunked prefill)
    row_check: bool = False  # ship the mirror of every row read, for the executor to compare
    prefix_cache: bool = True  # share full prompt pages across requests by a hash chain of their tokens

    def __post_init__(self) -> None:
        if self.prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be positive, got {self.prefill_token_budget}")


@dataclass(slots=True)
class PlannerConfig:
    # Executor addresses (host:port). Empty with in-process links.
    executors: list[str] = field(default_factory=list)
    # Tokenizer source: same meaning as ExecutorConfig.model (None = the SmolLM2 GGUF).
    model: str | None = None
    max_waiting: int = 1024  # queued requests before Generate answers RESOURCE_EXHAUSTED
    inflight_plans: int = 2  # plans in flight per executor: the step running and the next
    # Seconds a step may go without output (plus 25 ms per prompt token it reads) before its executor
    # counts as hung: lost, its requests failed or re-queued, and reconnected.
    executor_timeout: float = 5.0
    cache: str | None = None  # the cache service (host:port) for parked conversations; None = no parking
    scheduling: SchedulingConfig = field(
        default_factory=SchedulingConfig
    )  # chunked prefill, row check, prefixes
    retention: RetentionConfig = field(default_factory=RetentionConfig)  # checkpoints kept per conversation

    def __post_init__(self) -> None:
        if self.inflight_plans not in (1, 2):
            raise ValueError(f"inflight_plans must be 1 or 2, got {self.inflight_plans}")
        if not self.executor_timeout > 0:
            raise ValueError(f"executor_timeout must be positive, got {self.executor_timeout}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be positive, got {self.max_waiting}")
