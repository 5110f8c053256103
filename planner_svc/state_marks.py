"""Copies of a hybrid turn's recurrent state at the root and pin marks inside its prompt, and at its prompt's
end for a turn with stop strings (Request.state_marks; DESIGN §4): its prefill chunks end at them, and the step
after a chunk that ends at one copies the turn's state into a free state slot, before anything else of that
step; the conversation keeps it as that mark's checkpoint. No free slot then: no copy, and no checkpoint at
that mark (at a pin's, a warning and the turn's pin_note: the conversation keeps no pin until a later turn
reads through the prefix again with a slot free, or asks for it where a checkpoint holds the state)."""

from __future__ import annotations

import structlog

from planner_svc.planned import PlannedStep
from planner_svc.requests import Request
from planner_svc.state_slots import StateSlots

log = structlog.get_logger("deltaserve.planner.state_marks")


def _marks(request: Request) -> tuple[int, ...]:
    if request.conversation is None:
        return ()
    return tuple(m for m in request.state_marks if m not in request.marked_states)


class MarkCopies:
    """The marks whose chunk is planned and whose copy is not: each copy rides in the first step planned after
    the chunk's, which precedes any later step of the turn (so its state is still the mark's)."""

    def __init__(self, states: StateSlots) -> None:
        self.states = states
        self._due: list[tuple[Request, int]] = []  # chunks in steps planned before the one being planned
        self._new: list[tuple[Request, int]] = []  # chunks in the step being planned
        self._uncommitted: list[
            tuple[Request, int, int]
        ] = []  # (request, mark, step) of copies not committed

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """A prefill chunk's end: `end`, or the first mark in (start, end) (a model with recurrent layers)."""
        if not self.states.enabled:
            return end
        return min((m for m in _marks(request) if start < m < end), default=end)

    def step_begins(self, committed: int) -> None:
        """A step is planned; every step up to `committed` has run."""
        self._due += self._new
        self._new = []
        self._uncommitted = [copy for copy in self._uncommitted if copy[2] > committed]

    def chunk_planned(self, request: Request, end: int) -> None:
        if self.states.enabled and end in _marks(request):
            self._new.append((request, end))

    def copy_into(self, step: PlannedStep, waiting: int) -> None:
        """The due copies, into `step` (planned after their chunks'): a free state slot each, while any is; a
        prompt's end (a turn with stop strings) only from slots `waiting` requests do not need: its slot is held
        for the whole turn, and none of a running turn's copies is given back under pressure."""
        for request, mark in self._due:
            spare = self.states.free_count - (waiting if mark == request.prompt_len else 0)
            if request.state_slot and spare > 0:
                slot = self.states.take()
                step.state_copies.append((request.state_slot, slot))
                request.marked_states[mark] = slot
                self._uncommitted.append((request, mark, step.seq))
                request.last_seq = max(request.last_seq, step.seq)  # its release waits for the copy's commit
            elif mark == request.pinned and request.conversation is not None:
                request.pin_note = "no state slot was free for a copy of the prefix's state (state pressure)"
                log.warning(
                    "state pressure: no free state slot to keep the pinned prefix's state; the conversation "
                    "keeps no pin until a later turn reads through the prefix again with a slot free (or asks "
                    "for it where a checkpoint holds the state)",
                    conversation=request.conversation.conversation_id,
                    pinned_tokens=mark,
                    state_slots=self.states.total,
                )
        self._due = []

    def forget(self, committed: int) -> None:
        """The steps after `committed` were lost or refused: the chunks the copies follow may not have run,
        and the copies planned in them did not (their slots go back; no turn ends before its copies commit, so
        the request still holds each)."""
        for request, mark, seq in self._uncommitted:
            if seq > committed and mark in request.marked_states:
                self.states.give_back(request.marked_states.pop(mark))
                if mark == request.pinned:
                    request.pin_note = (
                        "the step copying the prefix's state did not run (its executor was lost or refused "
                        "a step)"
                    )
        self._due, self._new, self._uncommitted = [], [], []
