"""--max-waiting counted in choices: a request of n choices queues n requests, so it takes room for n. The
schedulers' waiting queues count the choices they hold; this counts those on their way to one: past the check
and being prepared (tokenizing, a turn's lock, a restore), and the later choices of n > 1, which are queued
only once the first has read the prompt (choices.py). With --max-waiting-per-tenant, each tenant's choices are
counted the same way against that share of the room too, so no tenant fills it for the others."""

from __future__ import annotations

from dataclasses import dataclass

from planner_svc.planned import CapacityError


@dataclass(slots=True)
class TenantShare:
    """A tenant's part of the room: its name, its choices in the schedulers' queues, and the most it may have
    waiting (--max-waiting-per-tenant; 0: no share of its own, only the room's limit)."""

    tenant: str
    queued: int
    limit: int


class WaitingRoom:
    def __init__(self) -> None:
        self.held = 0  # choices past the check and in no scheduler's waiting queue yet
        self._held_by: dict[str, int] = {}  # of those, each tenant's (where its share is limited)

    def enter(self, choices: int, queued: int, max_waiting: int, share: TenantShare | None = None) -> Held:
        """Room for a request's `choices` beside the `queued` ones (and within its tenant's `share`);
        CapacityError when there is none now (retryable), or never (more choices than a limit)."""
        share = share if share is not None and share.limit > 0 else None  # no share of its own
        if choices > max_waiting:
            raise CapacityError(
                f"n is {choices}: more choices than the waiting queue holds (--max-waiting {max_waiting})"
            )
        if share is not None and choices > share.limit:
            raise CapacityError(
                f"n is {choices}: more choices than a tenant may have waiting (--max-waiting-per-tenant "
                f"{share.limit})"
            )
        extra = f", no room for this request's {choices} choices" if choices > 1 else ""
        waiting = self.held + queued
        if waiting + choices > max_waiting:
            raise CapacityError(
                f"the waiting queue is full: {_choices(waiting)} for admission (--max-waiting "
                f"{max_waiting}){extra}; retry later",
                retryable=True,
            )
        tenant = None
        if share is not None:
            tenant = share.tenant
            mine = self._held_by.get(tenant, 0) + share.queued
            if mine + choices > share.limit:
                raise CapacityError(
                    f"tenant {tenant!r} has its share of the waiting queue: {_choices(mine)} for admission "
                    f"(--max-waiting-per-tenant {share.limit}){extra}; retry later",
                    retryable=True,
                )
            self._held_by[tenant] = self._held_by.get(tenant, 0) + choices
        self.held += choices
        return Held(self, choices, tenant)

    def _let_go(self, choices: int, tenant: str | None) -> None:
        self.held -= choices
        if tenant is not None and choices:
            left = self._held_by[tenant] - choices
            if left:
                self._held_by[tenant] = left
            else:
                del self._held_by[tenant]


def _choices(n: int) -> str:
    return f"{n} choice waits" if n == 1 else f"{n} choices wait"  # a request of n choices counts n


class Held:
    """One request's choices still counted by the room: each let go once, when a scheduler's queue takes it
    (it counts there from then) or when it will never be queued (refused, aborted, the client gone)."""

    def __init__(self, room: WaitingRoom, choices: int, tenant: str | None = None) -> None:
        self.room = room
        self.left = choices
        self.tenant = tenant  # whose share counts them too (None: no share of its own)

    def let_go(self, choices: int = 1) -> None:
        choices = min(choices, self.left)
        self.left -= choices
        self.room._let_go(choices, self.tenant)

    def close(self) -> None:
        self.let_go(self.left)
