"""Recurrent-state slot pressure at admission (a model with recurrent layers; DESIGN §4): the queue's head waits
for a free state slot while none is. Pressure takes back an idle conversation's checkpoint copy, never a pin's
(Conversations.drop_state_copy), and lets the turns that bring their own slot pass the head. Pure logic."""

from __future__ import annotations

from collections.abc import Callable

from planner_svc.conversations import Conversations
from planner_svc.requests import Request
from planner_svc.state_slots import StateSlots


class StatePressure:
    def __init__(self, states: StateSlots, conversations: Conversations | None) -> None:
        self.states = states
        self.conversations = conversations

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
