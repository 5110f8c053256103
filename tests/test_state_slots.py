"""The recurrent-state slot allocator, and the scheduler's use of it: a slot at admission, in the row's
STATE_SLOT column and the prefill chunk, back after the last step's commit; admission waits for one. A
conversation's turn keeps its state as its end's checkpoint copy, the next turn's first step copies it, and
the copies give their slots back under pressure."""

from __future__ import annotations

import numpy as np
import pytest

from planner_svc.conversations import Conversations
from planner_svc.recovery import recover
from planner_svc.requests import Request
from planner_svc.retention import RetentionConfig
from planner_svc.state_slots import StateSlots
from protos.layout import RowLayout
from tests.state_scheduler import marked_turn, run_until_idle, state_scheduler


def test_take_and_give_back():
    slots = StateSlots(4)
    assert slots.enabled and slots.total == 3 and slots.free_count == 3
    taken = [slots.take() for _ in range(3)]
    assert taken == [1, 2, 3]  # never the sink slot 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        slots.take()
    slots.give_back(2)
    with pytest.raises(ValueError, match="not taken"):
        slots.give_back(2)
    assert slots.take() == 2
    slots.check()


def test_reset_frees_every_slot_but_what_it_keeps():
    slots = StateSlots(5)
    for _ in range(3):
        slots.take()
    slots.reset(keep=[3])
    slots.check()
    assert slots.free_count == 3 and 3 not in [slots.take() for _ in range(3)]
    with pytest.raises(ValueError, match="not all pool slots"):
        slots.reset(keep=[0])
    slots.check()  # refused: nothing changed
    assert slots.free_count == 0


def test_none_for_a_model_without_recurrent_layers():
    slots = StateSlots(0)
    assert not slots.enabled and slots.total == 0
    with pytest.raises(ValueError, match="sink"):
        StateSlots(1)


def test_scheduler_ships_and_returns_state_slots():
    scheduler = state_scheduler(state_slots=2)  # one slot for requests
    assert not scheduler.prefix_cache
    first, second = Request("a", [5, 6, 7], max_tokens=2), Request("b", [8, 9], max_tokens=2)
    scheduler.add(first)
    scheduler.add(second)
    step = scheduler.plan(0)
    assert step is not None and [c.request for c in step.prefill] == [first]  # b waits for a state slot
    assert step.prefill[0].state_slot == first.state_slot == 1
    scheduler.commit(0, np.zeros(0, np.int32), np.array([11], np.int32))
    step = scheduler.plan(1)  # a's decode row, written whole with its state slot
    assert step is not None and step.rows == [first]
    row_slot = scheduler.slots.held_slot(first)
    assert scheduler.mirror.rows[row_slot, RowLayout.STATE_SLOT] == 1
    scheduler.commit(1, np.array([12], np.int32), np.zeros(0, np.int32))  # a's last token
    assert first.state_slot == 0 and scheduler.states.free_count == 1
    step = scheduler.plan(2)
    assert step is not None and step.prefill[0].request is second and step.prefill[0].state_slot == 1


def test_turns_keep_their_state_and_resume_from_a_copy_of_it():
    conversations = Conversations(4, RetentionConfig(cap=2))
    scheduler = state_scheduler(
        state_slots=3, conversations=conversations
    )  # two slots for requests and copies
    conversation = conversations.open("tenant", "chat")

    def turn(prompt: list[int], seq: int) -> tuple[Request, int, list[list[tuple[int, int]]]]:
        request = Request(f"turn{seq}", prompt, max_tokens=2)
        mount, release = conversations.mount(conversation, prompt)
        scheduler.return_pages(release)
        request.pages, request.reused, request.prefilled = mount.pages, mount.reused, mount.reused
        request.conversation, request.state_source = conversation, mount.state_slot
        scheduler.add(request)
        return (request, *run_until_idle(scheduler, seq))

    first, seq, copies = turn([5, 6, 7], 0)
    history = first.prompt_ids + first.output_ids  # its state read all but the last token
    assert conversation.states == {4: 1} and conversation.tokens == history[:4] and not any(copies)
    second, seq, copies = turn(history + [9], seq)
    assert second.reused == 4 and copies[0] == [(1, 2)] and not any(copies[1:])  # the first step copies
    assert conversation.states == {4: 1, 7: 2} and scheduler.states.free_count == 0
    history = second.prompt_ids + second.output_ids
    third, seq, copies = turn(history + [9], seq)  # no slot free for a copy: it takes its checkpoint's
    assert third.reused == 7 and not any(copies)
    assert conversation.states == {4: 1, 10: 2} and conversation.retention.positions == [4, 10]
    other = Request("other", [1, 2, 3], max_tokens=2)
    scheduler.add(other)  # no slot free: the conversation's older copy goes
    seq, _ = run_until_idle(scheduler, seq)
    assert conversation.states == {10: 2} and conversation.retention.positions == [10]
    scheduler.states.check()


def test_turns_of_busy_conversations_holding_every_slot_pass_a_head_that_waits_for_one():
    """Every state slot a checkpoint of a conversation whose next turn waits behind a new request: no copy can
    be dropped (their turns are mounted), so those turns pass the head whatever the skip count (each takes its
    checkpoint's own slot); their ends' copies are then idle, and one goes to the head."""
    conversations = Conversations(4, RetentionConfig())
    scheduler = state_scheduler(state_slots=3, conversations=conversations, admission_skips=0)
    chats = [conversations.open("tenant", name) for name in ("a", "b")]
    seq = 0
    for chat in chats:  # each keeps a checkpoint copy: both slots held
        request = Request(f"{chat.conversation_id}0", [5, 6, 7], max_tokens=2)
        conversations.mount(chat, request.prompt_ids)
        request.conversation = chat
        scheduler.add(request)
        seq, _ = run_until_idle(scheduler, seq)
    assert scheduler.states.free_count == 0
    head = Request("new", [1, 2, 3], max_tokens=2)
    scheduler.add(head)
    turns = []
    for chat in chats:
        request = Request(f"{chat.conversation_id}1", chat.tokens + [9, 9], max_tokens=2)
        mount, release = conversations.mount(chat, request.prompt_ids)
        scheduler.return_pages(release)
        request.pages, request.reused, request.prefilled = mount.pages, mount.reused, mount.reused
        request.conversation, request.state_source = chat, mount.state_slot
        scheduler.add(request)
        turns.append(request)
    seq, _ = run_until_idle(scheduler, seq)
    assert all(r.output_ids for r in [head, *turns])
    assert sum(len(chat.states) for chat in chats) == 1 and scheduler.states.free_count == 1  # one went to it
    scheduler.states.check()


def test_a_root_mark_inside_the_prompt_keeps_a_copy_of_the_state_there():
    scheduler, conversation, request = marked_turn(4, "chat", root=3)
    step = scheduler.plan(0)
    assert step is not None and [(c.start, len(c.token_ids) // 4) for c in step.prefill] == [
        (0, 3)
    ]  # cut at 3
    scheduler.commit(0, np.zeros(0, np.int32), np.array([-1], np.int32))
    step = scheduler.plan(1)  # the copy at the mark first, then the rest of the prompt
    assert step is not None and step.state_copies == [(1, 2)] and step.prefill[0].start == 3
    scheduler.commit(1, np.zeros(0, np.int32), np.array([30], np.int32))
    run_until_idle(scheduler, 2)
    assert conversation.states == {3: 2, 8: 1} and conversation.retention.root == 3
    scheduler.states.check()


def test_a_refused_step_leaves_no_checkpoint_of_steps_that_never_ran():
    scheduler, conversation, request = marked_turn(4, "chat", root=3)
    assert scheduler.plan(0) is not None  # the chunk up to the mark
    scheduler.commit(0, np.zeros(0, np.int32), np.array([-1], np.int32))
    step = scheduler.plan(1)  # the copy at the mark and the rest of the prompt: refused, so never run
    assert step is not None and step.state_copies == [(1, 2)] and request.marked_states == {3: 2}
    result = recover(scheduler, last_seq=1, refused_seq=1, reason="refused")
    assert result.refused == [request] and request.finish is not None
    assert not conversation.states and not conversation.busy  # neither the copy nor the turn's state
    assert scheduler.states.free_count == scheduler.states.total
    scheduler.states.check()


def test_a_prompt_end_copy_takes_only_a_slot_waiting_requests_do_not_need():
    """A turn with stop strings copies its state at its prompt's end and holds that slot for the whole turn:
    only a slot left over by the requests waiting is taken (a root mark's copy takes any free one)."""
    from planner_svc.planned import PlannedStep
    from planner_svc.state_marks import MarkCopies

    for waiting, copied in ((0, True), (1, False)):
        states = StateSlots(4)  # three slots
        marks = MarkCopies(states)
        request = Request("turn", [5, 6, 7], max_tokens=4, stop_strings=("x",), conversation=object())
        request.state_slot = states.take()
        states.take()  # one slot left
        marks.step_begins(0)
        marks.chunk_planned(request, 3)  # the prompt's last chunk
        marks.step_begins(0)
        step = PlannedStep(seq=2)
        marks.copy_into(step, waiting)
        assert bool(step.state_copies) == copied and (3 in request.marked_states) == copied
