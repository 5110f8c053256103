"""A pinned checkpoint of a hybrid conversation (a shared prefix's state copy) under state-slot pressure: pressure
never takes the pin's copy back (retention never evicts a pin). Pure classes: Conversations, StateSlots."""

from __future__ import annotations

from planner_svc.conversations import Conversations
from planner_svc.retention import RetentionConfig
from planner_svc.state_slots import StateSlots

PAGE = 4


def _pinned(states: StateSlots, conversations: Conversations, name: str = "pin"):
    """A conversation of 24 tokens whose last turn kept a pin's copy at 10 and its end's at 24, idle."""
    chat = conversations.open("tenant", name)
    conversations.mount(chat, list(range(3, 27)))
    pin_slot, end_slot = states.take(), states.take()
    conversations.finish_turn(
        chat,
        list(range(3, 27)),
        [1, 2, 3, 4, 5, 6],
        [],
        pinned=10,
        state_slot=end_slot,
        marked_states={10: pin_slot},
    )
    assert chat.states == {10: pin_slot, 24: end_slot} and chat.retention.pinned == 10 and chat.idle
    return chat, pin_slot, end_slot


def test_state_pressure_never_takes_a_pins_copy():
    """Pressure takes the newest's copy (the only other one), keeping the pin's copy and the pages; with only the
    pin's copy left the conversation is no candidate: nothing is freed, the pin holds."""
    states = StateSlots(4)
    conversations = Conversations(PAGE, RetentionConfig(), states)
    chat, pin_slot, _ = _pinned(states, conversations)
    assert conversations.drop_state_copy() == []  # the newest's copy went back; no page freed
    assert chat.states == {10: pin_slot} and chat.retention.positions == [10] and chat.retention.pinned == 10
    assert chat.pages == [1, 2, 3, 4, 5, 6] and states.free_count == 2
    assert conversations.drop_state_copy() is None  # nothing pressure may take
    assert chat.states == {10: pin_slot} and chat.retention.pinned == 10 and chat.pages
    # Its next turn resumes from the pin, as it was pinned.
    mount, _ = conversations.mount(chat, list(range(3, 27)) + [99])
    assert (mount.reused, mount.checkpoint, mount.state_slot) == (10, "checkpoint@10", pin_slot)
    states.check()


def test_state_pressure_takes_an_older_conversations_unpinned_copies_before_none():
    """The least recently used idle conversation holding an unpinned copy gives one: a pinned one used longer
    ago keeps its pin."""
    states = StateSlots(5)
    conversations = Conversations(PAGE, RetentionConfig(), states)
    pinned, pin_slot, _ = _pinned(states, conversations)
    pinned.drop_states([24])  # only the pin's copy left (as after pressure took its newest's)
    pinned.retention.remove(24)
    other = conversations.open("tenant", "other")
    conversations.mount(other, [5, 6, 7])
    conversations.finish_turn(other, [5, 6, 7], [7], [], state_slot=states.take())
    assert conversations.drop_state_copy() == [7] and not other.states and not other.tokens  # all it kept
    assert pinned.states == {10: pin_slot}
    states.check()
