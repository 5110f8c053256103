"""--max-waiting counted in choices: a request of n choices queues n requests, so it takes room for n. The
schedulers' waiting queues count the choices they hold; this counts those on their way to one: past the check
and being prepared (tokenizing, a turn's lock, a restore), and the later choices of n > 1, which are queued
only once the first has read the prompt (choices.py)."""

from __future__ import annotations

from planner_svc.planned import CapacityError


class WaitingRoom:
    def __init__(self) -> None:
        self.held = 0  # choices past the check and in no scheduler's waiting queue yet

    def enter(self, choices: int, queued: int, max_waiting: int) -> Held:
        """Room for a request's `choices` beside the `queued` ones; CapacityError when there is none now
        (retryable), or never (more choices than the limit)."""
        if choices > max_waiting:
            raise CapacityError(
                f"n is {choices}: more choices than the waiting queue holds (--max-waiting {max_waiting})"
            )
        waiting = self.held + queued
        if waiting + choices > max_waiting:
            extra = f", no room for this request's {choices} choices" if choices > 1 else ""
            wait = "choice waits" if waiting == 1 else "choices wait"  # a request of n choices counts n
            raise CapacityError(
                f"the waiting queue is full: {waiting} {wait} for admission (--max-waiting "
                f"{max_waiting}){extra}; retry later",
                retryable=True,
            )
        self.held += choices
        return Held(self, choices)


class Held:
    """One request's choices still counted by the room: each let go once, when a scheduler's queue takes it
    (it counts there from then) or when it will never be queued (refused, aborted, the client gone)."""

    def __init__(self, room: WaitingRoom, choices: int) -> None:
        self.room = room
        self.left = choices

    def let_go(self, choices: int = 1) -> None:
        choices = min(choices, self.left)
        self.left -= choices
        self.room.held -= choices

    def close(self) -> None:
        self.let_go(self.left)
