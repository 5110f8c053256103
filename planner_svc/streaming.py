"""Which requests' new tokens go to their client streams this step: the oldest waiting first, as many as
the time the step loop would otherwise spend waiting for the executor pays for."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import Generic, TypeVar

from planner_svc.logprobs import LogprobRow
from planner_svc.requests import Finish

Key = TypeVar("Key")


@dataclass(slots=True)
class TokenEvent:
    """Tokens for one request since its last event; `finish` set on its last."""

    token_ids: list[int]
    finish: Finish | None = None
    error: str | None = None  # the request ends with this message and status `code`
    code: str = "UNAVAILABLE"  # a grpc.StatusCode name: UNAVAILABLE (executor lost), INTERNAL (plan refused)
    logprobs: list[LogprobRow | None] = field(default_factory=list)  # by token, where the request asked

    def join(self, later: TokenEvent) -> None:
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.finish, self.error, self.code = later.finish, later.error, later.code


@dataclass(slots=True)
class PendingTokens(Generic[Key]):
    """Tokens produced and not yet handed to their streams, one event per request, oldest first."""

    _events: dict[Key, TokenEvent] = field(default_factory=dict)  # insertion order: age of the oldest token

    def __len__(self) -> int:
        return len(self._events)

    def add(self, key: Key, token: int, finish: Finish | None, logprobs: LogprobRow | None = None) -> None:
        event = self._events.get(key)
        if event is None:
            self._events[key] = TokenEvent([token], finish, logprobs=[logprobs])
        else:
            event.token_ids.append(token)
            event.logprobs.append(logprobs)
            event.finish = finish

    def take(self, count: int) -> list[tuple[Key, TokenEvent]]:
        """The `count` requests whose tokens waited longest, removed."""
        events = self._events
        if count >= len(events):  # every stream: the usual case below a few dozen requests
            taken = list(events.items())
            events.clear()
            return taken
        taken = list(islice(events.items(), max(count, 0)))
        for key, _ in taken:
            del events[key]
        return taken

    def drop(self, key: Key) -> None:
        self._events.pop(key, None)


@dataclass(slots=True)
class StreamBudget:
    """How many streams to write to per step, so that the writes end before the next output arrives.

    A write to a client stream costs the planner's event loop ~25-30 µs (gRPC), the same loop that receives
    the executor's outputs and sends the plans. Writes released just before the loop waits for an output
    run while the GPU works; more than fit there delay the next plan and idle the GPU. So each step
    observes how long the released writes ran and how long the loop waited in all: half the slack beyond
    `headroom_us` buys more writes next step, a shortfall cuts them by a quarter. Requests not written keep
    their tokens, which go out joined in one message later (a loaded server streams in bursts, not slower).

    The writes are timed only until they are issued (their completions run on the loop later), so a full loop
    can look slack. The executor's word settles it: a step whose device waited for its plan more than
    `idle_us` cuts the writes by a quarter too.
    """

    min_writes: int = 8  # every step writes at least this many streams (progress for every client)
    headroom_us: float = 150.0  # slack kept between the writes' end and the next output
    writes: float = 64.0  # the current allowance
    write_us: float = 30.0  # the running estimate of one write's cost
    max_writes: int = 4096
    idle_us: float = (
        40.0  # a device wait for a plan above this is the loop's fault (the steady gap is ~20 µs)
    )

    def __post_init__(self) -> None:
        if self.min_writes < 1:
            raise ValueError(f"min_writes must be positive, got {self.min_writes}")
        if self.headroom_us < 0:
            raise ValueError(f"headroom_us must not be negative, got {self.headroom_us}")
        if self.idle_us < 0:
            raise ValueError(f"idle_us must not be negative, got {self.idle_us}")
        if not self.min_writes <= self.writes <= self.max_writes:
            raise ValueError(f"writes must be in [{self.min_writes}, {self.max_writes}], got {self.writes}")

    def allowance(self) -> int:
        return int(self.writes)

    def observe(self, written: int, writes_us: float, wait_us: float, device_wait_us: float = 0.0) -> None:
        """One step: `written` streams released, which ran for `writes_us`, within a wait of `wait_us` for
        the executor's output (the writes included); the device waited `device_wait_us` for that step's plan."""
        if written:
            self.write_us += 0.25 * (max(writes_us / written, 1.0) - self.write_us)
        slack = wait_us - writes_us - self.headroom_us
        # The output waited behind the writes for an unknown time, or the device for the plan: back off by a
        # quarter. Otherwise spend half the slack, at most a sixteenth more a step: the device's word comes
        # two steps late, and the slack can be an illusion (above).
        short = slack < 0 or device_wait_us > self.idle_us
        grown = (
            self.writes * 0.75
            if short
            else self.writes + min(0.5 * slack / self.write_us, self.writes / 16 + 1)
        )
        self.writes = min(max(grown, self.min_writes), self.max_writes)
