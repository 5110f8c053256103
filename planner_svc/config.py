"""Planner settings, checked where they are made; each setting has one home (the scheduler's and the
retention's settings are theirs, nested here)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from planner_svc.retention import RetentionConfig
from protos.layout import MAX_DECODE_STEPS

# Prompt tokens read per step by default, by the executor's device. A GPU reads 8,192 in a few tens of ms
# (Qwen3.5-0.8B on the H200: ~40 ms, where four steps of 2,048 each ran the step's other work again: 64
# requests of 512 tokens ran 10% faster end to end, 256 as much); a CPU reads a few hundred a second, so
# 2,048 there held every other stream's next token for tens of seconds (a 6,000-token prompt: up to 42 s a
# step); 256 keeps a step to about a second.
CPU_PREFILL_TOKEN_BUDGET = 256
GPU_PREFILL_TOKEN_BUDGET = 8192
# Decode steps a steady plan runs by default, by the executor's device. A CPU step of a small model takes
# ~10 ms, and the planner, the executor's loop and gRPC spend ~1.8 ms of the same two cores on each plan and
# its output; four steps a plan share that. A GPU step takes less than a message: one a plan, pipelined.
CPU_DECODE_STEPS = 4


@dataclass(slots=True)
class SchedulingConfig:
    """The planner's settings of every scheduler (carried by SchedulerConfig.settings)."""

    # Prompt tokens read per step (chunked prefill); None: by the executor's device (for_device).
    prefill_token_budget: int | None = None
    # Decode steps a steady plan runs over the same rows; None: by the executor's device (for_device).
    decode_steps: int | None = None
    row_check: bool = False  # ship the mirror of every row read, for the executor to compare
    prefix_cache: bool = True  # share full prompt pages across requests by a hash chain of their tokens

    # Requests that may be admitted past a head of the queue waiting for pages (admission.py).
    admission_skips: int = 32

    def __post_init__(self) -> None:
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be positive, got {self.prefill_token_budget}")
        if self.decode_steps is not None and not 1 <= self.decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps must be in [1, {MAX_DECODE_STEPS}], got {self.decode_steps}")
        if self.admission_skips < 0:
            raise ValueError(f"admission_skips must be >= 0, got {self.admission_skips}")

    @property
    def token_budget(self) -> int:
        """The prefill budget in force (a GPU's where none was chosen and no device was named)."""
        return self.prefill_token_budget or GPU_PREFILL_TOKEN_BUDGET

    @property
    def steps_per_plan(self) -> int:
        """The decode steps of a steady plan in force (one where none was chosen and no device was named)."""
        return self.decode_steps or 1

    def for_device(self, device: str) -> SchedulingConfig:
        """These settings with the prefill budget and decode steps chosen for `device` (the executor's),
        where none was given."""
        cpu = device.split(":")[0] == "cpu"
        return replace(
            self,
            prefill_token_budget=self.prefill_token_budget
            or (CPU_PREFILL_TOKEN_BUDGET if cpu else GPU_PREFILL_TOKEN_BUDGET),
            decode_steps=self.decode_steps or (CPU_DECODE_STEPS if cpu else 1),
        )


DEFAULT_MAX_WAITING = 1024
MAX_MODEL_NAME_CHARS = 256


def model_name_error(name: str) -> str | None:
    """What is wrong with a name to serve the model under (requests give it as `model`), or None."""
    if not name or name != name.strip():
        return f"a model name must be non-empty without spaces at its ends, got {name!r}"
    if len(name) > MAX_MODEL_NAME_CHARS:
        return f"a model name has at most {MAX_MODEL_NAME_CHARS} characters, got {len(name)}"
    if not name.isprintable():
        return f"a model name must be printable, got {name!r}"
    return None


@dataclass(slots=True)
class PlannerConfig:
    # Executor addresses (host:port). Empty with in-process links.
    executors: list[str] = field(default_factory=list)
    # Stage groups of a layer split, each its stages' addresses in rank order: each group is one executor
    # to the planner (data parallel beside the whole executors and the other groups).
    executor_groups: list[list[str]] = field(default_factory=list)
    # Tokenizer source: same meaning as ExecutorConfig.model (None = the SmolLM2 GGUF).
    model: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING  # waiting choices (n per request) before RESOURCE_EXHAUSTED
    max_waiting_per_tenant: int = 0  # of those, the most one tenant may have; 0: no share of its own
    # max_tokens of a request that leaves it unset (0: as many as fit after the prompt, OpenAI's default):
    # admission gives a request the pages of all it may write, so that default holds a whole context's.
    default_max_tokens: int = 0
    # The name the API serves the model under (GET /v1/models' id, what requests give as `model`); None:
    # the executor's model name (the checkpoint's own).
    served_model_name: str | None = None
    # A Jinja chat template (its text) in place of the tokenizer's own; None: the tokenizer's.
    chat_template: str | None = None
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
        for group in self.executor_groups:
            if len(group) < 2:
                raise ValueError(f"a stage group needs two or more executors, got {group}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be positive, got {self.max_waiting}")
        if self.max_waiting_per_tenant < 0:
            raise ValueError(f"max_waiting_per_tenant must be >= 0, got {self.max_waiting_per_tenant}")
        if self.default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0, got {self.default_max_tokens}")
        name_error = None if self.served_model_name is None else model_name_error(self.served_model_name)
        if name_error:
            raise ValueError(f"served_model_name: {name_error}")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("chat_template is empty: give a template, or None for the tokenizer's own")
