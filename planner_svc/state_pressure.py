"""Recurrent-state slot pressure at admission (a model with recurrent layers; DESIGN §4): the queue's head waits
for a free state slot while none is. Pressure takes back an idle conversation's checkpoint copy, never a pin's
(Conversations.drop_state_copy), and lets the turns that bring their own slot pass the head; `stuck` says when
nothing will ever free one, so that the head is refused rather than a pin dropped. Pure logic."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import islice

from planner_svc.admission import SCAN_LIMIT
from planner_svc.conversations import Conversations
from planner_svc.loans import Loans
from planner_svc.requests import Request
from planner_svc.state_slots import StateSlots


class StatePressure:
    def __init__(
        self,
        states: StateSlots,
        conversations: Conversations | None,
        loans: Loans,
        scan_limit: int = SCAN_LIMIT,
    ) -> None:
        self.states = states
        self.conversations = conversations
        self.loans = loans
        self.scan_limit = scan_limit  # admission's: a request further back passes no head this step

    def passing(self, waiting: Sequence[Request]) -> bool:
        """A waiting turn that brings its own slot will pass the starved head: one admission scans (a turn further
        back frees nothing until the queue moves up to it)."""
        return any(request.brings_state for request in islice(waiting, self.scan_limit))

    def starved(self, request: Request) -> bool:
        """It waits for a free state slot, and none is free."""
        return self.states.enabled and not request.brings_state and not self.states.free_count

    def before_admission(self, head: Request | None) -> tuple[list[int], Callable[[Request], bool] | None]:
        """The head starved: an idle conversation's copy goes back (the pages returned are those a conversation
        forgot, to free). Where still none is free, every slot held is a copy none may drop or a running
        request's: the turns that bring their own slot (their copy none may drop: their conversation waits,
        mounted on it) pass the head whatever the skip count (the filter returned); their ends' copies are idle
        then."""
        if head is None or not self.starved(head):
            return [], None
        freed = (self.conversations.drop_state_copy() if self.conversations else None) or []
        return freed, (lambda r: r.brings_state) if not self.states.free_count else None

    def take_slot(self, request: Request) -> None:
        """Its slot at admission: a free one, or (none free) its checkpoint's own, never a pin's (brings_state)."""
        if self.states.free_count or not request.state_source:
            request.state_slot = self.states.take()
        else:  # no free slot for its checkpoint's copy: the turn takes the checkpoint's own slot
            assert request.conversation is not None
            request.conversation.hand_over_state(request.state_source)
            request.state_slot, request.state_source = request.state_source, 0

    def stuck(self, waiting: Sequence[Request], stalled: bool) -> str | None:
        """Why the queue's head can never get a free state slot as things stand; None while something may free
        one: a request running or awaiting its last commit (`stalled` False), a waiting turn that brings its own
        slot within admission's scan (`passing`), a restore or a park under way, an idle conversation's copy
        other than its pin's. What is left holds copies pressure may never take back: pins' (retention never
        evicts a pin), and those of conversations whose turns wait (mounted)."""
        head = waiting[0] if waiting else None
        if head is None or not stalled or not self.starved(head) or self.loans.lending_states:
            return None
        if self.passing(waiting):
            return None
        conversations = self.conversations.every() if self.conversations else []
        if any(c.parking or (c.idle and set(c.states) - {c.retention.pinned}) for c in conversations):
            return None
        pins = sum(1 for c in conversations if c.pin_copy)
        return (
            f"the request needs a free recurrent-state slot and none will come back: every one of the pool's "
            f"{self.states.total} holds a checkpoint's state copy that pressure does not take back ({pins} of "
            f"them pinned shared prefixes', never evicted) and no request runs; delete (or park) a conversation "
            f"holding a pinned prefix, or give the executor more --state-slots"
        )
