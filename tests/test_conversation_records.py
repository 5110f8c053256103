"""Which conversation records keep nothing (Conversations.emptied), and when a sweep of them is due."""

from __future__ import annotations

from planner_svc import conversations as conversations_module
from planner_svc.conversations import Conversations
from planner_svc.retention import RetentionConfig


def test_emptied_records_keep_nothing_and_run_nothing(monkeypatch):
    monkeypatch.setattr(conversations_module, "_FIRST_SWEEP", 6)
    conversations = Conversations(4, RetentionConfig())
    holding = conversations.open("t", "holding")
    conversations.finish_turn(holding, [1, 2, 3, 4, 5], [7, 8], [5])
    parked = conversations.open("t", "parked")
    parked.tokens, parked.parked = [1, 2], True
    lost = conversations.open("t", "lost")
    lost.lost = "its KV was lost with executor x"  # said by its next turn
    conversations.open("t", "running").busy = True
    conversations.open("t", "parking").parking = True
    assert not conversations.due_for_sweep()
    emptied = conversations.open("t", "emptied")
    forgotten = conversations.open("u", "forgotten")
    forgotten.tokens, forgotten.pages = [1], [3]
    forgotten.forget()

    assert conversations.emptied() == [emptied, forgotten]
    assert conversations.due_for_sweep()
    for record in conversations.emptied():
        conversations.remove(record)
    conversations.swept()
    assert not conversations.due_for_sweep()  # the next at twice the 5 records left (at least 6)
    for n in range(4):
        conversations.open("t", f"new-{n}")
    assert not conversations.due_for_sweep()
    conversations.open("t", "tenth")
    assert conversations.due_for_sweep()
