"""Which requests' tokens go to their streams each step: the oldest first, within the writes a step pays for."""

from __future__ import annotations

import pytest

from planner_svc.requests import Finish
from planner_svc.streaming import PendingTokens, StreamBudget, TokenEvent


def test_pending_tokens_join_per_request_and_go_oldest_first():
    pending: PendingTokens[str] = PendingTokens()
    pending.add("a", 1, None)
    pending.add("b", 2, None)
    pending.add("a", 3, None)
    pending.add("c", 4, Finish.STOP)
    assert len(pending) == 3
    first = pending.take(2)
    assert [(key, event.token_ids, event.finish) for key, event in first] == [
        ("a", [1, 3], None),
        ("b", [2], None),
    ]
    pending.add("a", 5, Finish.LENGTH)  # a's new token is now the youngest
    assert [(key, event.token_ids) for key, event in pending.take(5)] == [("c", [4]), ("a", [5])]
    assert len(pending) == 0 and pending.take(3) == []


def test_pending_tokens_drop_forgets_a_request():
    pending: PendingTokens[str] = PendingTokens()
    pending.add("a", 1, None)
    pending.add("b", 2, None)
    pending.drop("a")
    pending.drop("unknown")
    assert [key for key, _ in pending.take(9)] == ["b"]


def test_token_event_join_keeps_order_and_takes_the_later_finish():
    event = TokenEvent([1, 2])
    event.join(TokenEvent([3], Finish.ABORT, error="gone"))
    assert event == TokenEvent([1, 2, 3], Finish.ABORT, "gone")


def test_budget_grows_while_the_loop_waits_for_the_gpu():
    budget = StreamBudget(min_writes=2, headroom_us=100.0, writes=4.0, write_us=30.0)
    for _ in range(60):  # 4 writes of 30 µs inside a 1 ms wait: 780 µs of slack each step
        budget.observe(budget.allowance(), 30.0 * budget.allowance(), 1000.0)
        if budget.allowance() * 30.0 > 900:
            break
    # settles where the writes fill the wait but the headroom
    assert 25 <= budget.allowance() <= 31


def test_budget_shrinks_when_writes_delay_the_next_output():
    budget = StreamBudget(min_writes=2, headroom_us=100.0, writes=256.0, write_us=30.0)
    # 256 writes took 7.7 ms and the output had been waiting behind them
    budget.observe(256, 7680.0, 7700.0)
    assert budget.allowance() == 192
    allowed = []
    for _ in range(40):
        written = budget.allowance()
        allowed.append(written)
        # the GPU step is 2 ms: the loop waits max(2 ms, the writes) for its output
        budget.observe(written, 30.0 * written, max(2000.0, 30.0 * written + 20.0))
    # 63 writes fit in 2 ms but the headroom; it hovers just under that
    assert max(allowed[-20:]) <= 64 and 55 <= sum(allowed[-20:]) / 20 <= 64


def test_budget_backs_off_when_the_device_waited_for_a_plan():
    """The writes look cheap (timed until issued) and the loop slack, yet the executor says its device sat idle
    waiting for the plan: the writes shrink until it stops saying so, then grow again."""
    budget = StreamBudget(min_writes=8, headroom_us=100.0, writes=64.0, write_us=30.0)
    allowed = []
    for _ in range(40):
        written = budget.allowance()
        allowed.append(written)
        # issuing a write looks like 10 µs; what they really cost delays the plans once more than 30 go out
        budget.observe(written, 10.0 * written, 2000.0, device_wait_us=300.0 if written > 30 else 20.0)
    assert allowed[1] == 48  # cut by a quarter at once
    assert min(allowed) >= 8 and sum(w > 30 for w in allowed[-20:]) <= 5


def test_budget_never_goes_below_its_minimum():
    budget = StreamBudget(min_writes=3, writes=3.0)
    for _ in range(5):
        budget.observe(0, 0.0, 0.0)  # the loop itself is late: nothing left to give but the minimum
    assert budget.allowance() == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(min_writes=0), "min_writes must be positive"),
        (dict(headroom_us=-1.0), "headroom_us must not be negative"),
        (dict(idle_us=-1.0), "idle_us must not be negative"),
        (dict(min_writes=8, writes=4.0), "writes must be in [8, 4096]"),
    ],
)
def test_budget_refuses_bad_settings(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        StreamBudget(**fields)
