"""A pinned checkpoint of a hybrid conversation (a shared prefix's state copy) under state-slot pressure: pressure
never takes the pin's copy back (retention never evicts a pin), and a turn resuming from the pin copies it into a
free slot rather than taking the pin's own. Pure classes: Conversations, StateSlots, the scheduler."""

from __future__ import annotations

import numpy as np

from planner_svc.conversations import Conversations
from planner_svc.requests import Request
from planner_svc.retention import RetentionConfig
from planner_svc.state_pressure import StatePressure
from planner_svc.state_slots import StateSlots
from tests.state_scheduler import PAGE, marked_turn, run_until_idle, state_scheduler


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


def test_a_turn_resuming_from_its_pin_waits_for_a_free_slot_rather_than_take_the_pins():
    """Two state slots: the pin's copy and a request running. The conversation's turn, its history edited after
    the pin, resumes from the pin: it waits for the running request's slot and copies the pin's state into it,
    so the pin still holds after the turn (taking the pin's own slot would end the pin with the turn)."""
    scheduler, chat, first = marked_turn(3, "pin", pinned=3)
    conversations = scheduler.conversations
    assert conversations is not None
    seq, _ = run_until_idle(scheduler, 0)
    pin_slot, end_slot = chat.states[3], chat.states[8]
    assert sorted(chat.states) == [3, 8] and chat.retention.pinned == 3 and not scheduler.states.free_count
    other = Request("other", [1, 2, 3], max_tokens=3)
    scheduler.add(other)
    turn = Request("turn1", first.prompt_ids[:5] + [40, 41], max_tokens=2)
    mount, release = conversations.mount(chat, turn.prompt_ids)  # diverged at 5: the end's copy goes back
    scheduler.return_pages(release)
    assert (mount.reused, mount.state_slot, scheduler.states.free_count) == (3, pin_slot, 1)
    turn.pages, turn.reused, turn.prefilled = mount.pages, mount.reused, mount.reused
    turn.conversation, turn.state_source = chat, mount.state_slot
    scheduler.add(turn)
    step = scheduler.plan(seq)  # `other` takes the free slot; the turn waits for one
    assert step is not None and [c.request for c in step.prefill] == [other]
    assert turn.state_slot == 0 and chat.states[3] == pin_slot
    scheduler.commit(seq, np.zeros(0, np.int32), np.array([50], np.int32))
    seq, copies = run_until_idle(scheduler, seq + 1)
    assert turn.output_ids and [c for c in copies if c] == [[(pin_slot, end_slot)]]
    assert chat.retention.pinned == 3 and chat.states[3] == pin_slot  # the pin holds
    assert sorted(chat.states) == [3, len(turn.prompt_ids) + 1]
    scheduler.states.check()


def _only_pins(names: tuple[str, ...], states: StateSlots, conversations: Conversations) -> list:
    """Idle conversations each keeping its pin's copy alone (as after a restore short of state slots)."""
    chats = []
    for name in names:
        chat = conversations.open("tenant", name)
        conversations.mount(chat, list(range(3, 27)))
        conversations.finish_turn(
            chat, list(range(3, 27)), [1], [], pinned=10, marked_states={10: states.take()}
        )
        assert list(chat.states) == [10] and chat.pin_copy
        chats.append(chat)
    return chats


def test_every_slot_a_pins_copy_and_nothing_running_is_stuck_saying_what_it_needs():
    conversations = Conversations(PAGE, RetentionConfig())
    scheduler = state_scheduler(state_slots=3, conversations=conversations)
    chats = _only_pins(("a", "b"), scheduler.states, conversations)
    head = Request("new", [1, 2, 3], max_tokens=2)
    scheduler.add(head)
    assert scheduler.plan(0) is None and scheduler.blocked()  # it waits: no pin was dropped for it
    assert all(c.retention.pinned == 10 and list(c.states) == [10] for c in chats)
    pressure = scheduler.pressure
    why = pressure.stuck(scheduler.waiting, scheduler.stalled)
    assert why == (
        "the request needs a free recurrent-state slot and none will come back: every one of the pool's 2 holds "
        "a checkpoint's state copy that pressure does not take back (2 of them pinned shared prefixes', never "
        "evicted) and no request runs; delete (or park) a conversation holding a pinned prefix, or give the "
        "executor more --state-slots"
    )
    assert pressure.stuck(scheduler.waiting, stalled=False) is None  # a running request's slot comes back
    chats[0].parking = True  # a park under way gives its slots back
    assert pressure.stuck(scheduler.waiting, scheduler.stalled) is None
    chats[0].parking = False
    loan = scheduler.loans.lend(
        [], [1]
    )  # a restore under way: its slots come back or to an idle conversation
    assert pressure.stuck(scheduler.waiting, scheduler.stalled) is None
    scheduler.loans.end(loan)
    assert pressure.stuck(scheduler.waiting, scheduler.stalled) is not None


def test_a_waiting_turn_that_brings_its_slot_or_an_unpinned_idle_copy_is_not_stuck():
    conversations = Conversations(PAGE, RetentionConfig())
    scheduler = state_scheduler(state_slots=3, conversations=conversations)
    pinned, plain = _only_pins(("a", "b"), scheduler.states, conversations)
    plain.retention = type(plain.retention)(plain.retention.config)  # its copy is an ordinary checkpoint's
    plain.retention.add(10)
    assert not plain.pin_copy
    waiting = [Request("new", [1, 2, 3], max_tokens=2)]
    assert scheduler.pressure.stuck(waiting, stalled=True) is None  # pressure takes the plain one's copy
    plain.busy = True  # its turn waits, mounted on that copy: it brings its slot and passes the head
    turn = Request("turn", list(range(3, 15)), max_tokens=2)
    turn.conversation, turn.state_source = plain, plain.states[10]
    assert turn.brings_state and scheduler.pressure.stuck([*waiting, turn], stalled=True) is None
    resumed = Request(
        "pinned-turn", list(range(3, 15)), max_tokens=2
    )  # resuming from a pin: needs a free one
    resumed.conversation, resumed.state_source = pinned, pinned.pin_copy
    assert not resumed.brings_state
    assert scheduler.pressure.stuck([*waiting, resumed], stalled=True) is not None


def test_a_turn_bringing_its_slot_counts_only_where_admission_scans():
    """Admission looks at the first `scan_limit` waiting requests: a turn bringing its slot further back passes
    no head, so the head is stuck (as the scheduler's admission, its pressure scans the same number)."""
    conversations = Conversations(PAGE, RetentionConfig())
    scheduler = state_scheduler(state_slots=3, conversations=conversations)
    assert scheduler.pressure.scan_limit == scheduler.admission.scan_limit
    _, plain = _only_pins(("a", "b"), scheduler.states, conversations)
    plain.retention = type(plain.retention)(plain.retention.config)
    plain.retention.add(10)
    plain.busy = True  # its turn waits, mounted on its copy
    turn = Request("turn", list(range(3, 15)), max_tokens=2)
    turn.conversation, turn.state_source = plain, plain.states[10]
    ahead = [Request(f"new{i}", [1, 2, 3], max_tokens=2) for i in range(3)]
    pressure = StatePressure(scheduler.states, conversations, scheduler.loans, scan_limit=3)
    assert pressure.passing([*ahead[:2], turn]) and pressure.stuck([*ahead[:2], turn], stalled=True) is None
    assert not pressure.passing([*ahead, turn]) and pressure.stuck([*ahead, turn], stalled=True) is not None


def test_a_pin_without_a_free_slot_for_its_copy_is_not_kept_and_the_log_says_so():
    """One state slot, the turn's own: at its pin mark no slot is free for the copy, so the conversation keeps no
    pin; a warning names the conversation (the client sees pinned_prefix 0 in ListConversations)."""
    from structlog.testing import capture_logs

    scheduler, chat, turn = marked_turn(2, "pin", pinned=3)
    turn.pin_asked = True
    with capture_logs() as logs:
        run_until_idle(scheduler, 0)
    assert turn.output_ids and chat.retention.pinned is None and 3 not in chat.states
    assert (
        turn.released
        and turn.pin_note == "no state slot was free for a copy of the prefix's state (state pressure)"
    )
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [(e["conversation"], e["pinned_tokens"], e["state_slots"]) for e in warnings] == [("pin", 3, 1)]
    assert "keeps no pin" in warnings[0]["event"]
    scheduler.states.check()


def test_a_turn_resumed_past_its_prefix_pins_the_checkpoint_copy_kept_there():
    """A hybrid's pin needs the state at it: a turn resuming past the prefix copies none, but where the
    conversation already keeps a checkpoint's copy there (its root's), that checkpoint becomes the pin."""
    states = StateSlots(4)
    conversations = Conversations(PAGE, RetentionConfig(), states)
    chat = conversations.open("tenant", "late")
    conversations.mount(chat, list(range(3, 27)))
    root_slot = states.take()
    conversations.finish_turn(
        chat,
        list(range(3, 27)),
        [1, 2, 3, 4, 5, 6],
        [],
        root=10,
        state_slot=states.take(),
        marked_states={10: root_slot},
    )
    assert chat.retention.pinned is None
    mount, _ = conversations.mount(chat, list(range(3, 31)))
    assert mount.reused == 24  # past the prefix the next turn pins
    conversations.finish_turn(
        chat, list(range(3, 31)), [1, 2, 3, 4, 5, 6, 7], [], pinned=10, state_slot=states.take()
    )
    assert chat.retention.pinned == 10 and chat.states[10] == root_slot
    states.check()
