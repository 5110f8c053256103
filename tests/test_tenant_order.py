"""Tenants take turns in the waiting queue (tenant_order.py): pure logic, then the scheduler admitting by it.
A request costs its `end_len` in tokens: one each in the tests of the order alone, unless they name another."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from planner_svc.requests import Request
from planner_svc.tenant_order import TenantOrder
from tests.state_scheduler import state_scheduler


@dataclass
class Queued:
    tenant: str
    name: str
    end_len: int = 1
    queue_tag: int = 0
    n: int = 1
    later_choice: bool = False


def _queue(order: TenantOrder, waiting: deque[Queued], *arrivals: str, tokens: int = 1) -> None:
    for arrival in arrivals:
        tenant, _ = arrival.split(".")
        order.place(waiting, Queued(tenant, arrival, tokens))


def _names(waiting: deque[Queued]) -> list[str]:
    return [q.name for q in waiting]


def test_one_tenant_is_first_come_first_served():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, "a.1", "a.2", "a.3")
    assert _names(waiting) == ["a.1", "a.2", "a.3"]


def test_a_tenant_arriving_behind_a_flood_waits_one_turn_not_the_flood():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, *(f"a.{i}" for i in range(1, 7)), "b.1", "b.2", "c.1")
    assert _names(waiting) == ["a.1", "b.1", "c.1", "a.2", "b.2", "a.3", "a.4", "a.5", "a.6"]


def test_a_turn_is_tokens_a_tenant_of_short_requests_gets_many_through_for_a_long_one():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, "a.1", "a.2", tokens=100)
    _queue(order, waiting, *(f"b.{i}" for i in range(1, 8)), tokens=20)
    assert _names(waiting) == ["a.1", "b.1", "b.2", "b.3", "b.4", "b.5", "a.2", "b.6", "b.7"]


def test_a_long_request_aborted_while_waiting_gives_its_tokens_back():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, "a.1", tokens=20)
    _queue(order, waiting, "a.2", tokens=1000)
    long = waiting[-1]
    waiting.remove(long)
    order.forget(waiting, long)
    _queue(order, waiting, "b.1", "b.2", tokens=20)
    _queue(order, waiting, "a.3", tokens=20)
    assert _names(waiting) == ["a.1", "b.1", "b.2", "a.3"]  # a.3 starts where a.1 ends, not past a.2


def test_a_request_of_n_choices_is_charged_n_turns_and_its_later_choices_take_its_place():
    order, waiting = TenantOrder(), deque[Queued]()
    first = Queued("a", "a.1", end_len=10, n=3)
    order.place(waiting, first)
    _queue(order, waiting, "a.2", "b.1", "b.2", "b.3", "b.4", tokens=10)
    assert _names(waiting) == ["a.1", "b.1", "b.2", "b.3", "a.2", "b.4"]
    _admit(order, waiting, "a.1", "b.1")  # the first has read the prompt: its later choices queue
    for index in (2, 3):
        order.place(
            waiting, Queued("a", f"a.1#{index}", end_len=10, queue_tag=first.queue_tag, later_choice=True)
        )
    assert _names(waiting) == ["a.1#2", "a.1#3", "b.2", "b.3", "a.2", "b.4"]
    later = waiting[0]
    waiting.remove(later)
    order.forget(waiting, later)  # charged with the first, which ran: nothing moves
    assert [q.queue_tag for q in waiting] == [0, 10, 20, 30, 30]


def test_an_abort_gives_back_its_own_tokens_only_not_those_of_the_tenants_request_that_ran():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, "b.1", "a.1", tokens=20)
    _queue(order, waiting, "a.2", tokens=1000)
    _admit(order, waiting, "a.1")  # past b.1, which waits for pages: the clock stays at 0
    (long,) = [q for q in waiting if q.name == "a.2"]
    waiting.remove(long)
    order.forget(waiting, long)
    _queue(order, waiting, "a.3", tokens=20)
    assert [(q.name, q.queue_tag) for q in waiting] == [("b.1", 0), ("a.3", 20)]


def test_an_abort_moves_no_request_past_the_clock():
    """A request requeued by a recovery keeps its old tag, below the tenant's newer ones, which were tagged from
    the clock, not from it: aborting it must not move those ahead of other tenants' waiting requests."""
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, "b.1", "a.1", tokens=10)
    _admit(order, waiting, "b.1", "a.1")
    _queue(order, waiting, "c.1", "a.2", tokens=10)  # tagged from the clock, 10
    requeued = Queued("a", "a.1", end_len=10, queue_tag=0)  # a.1 back from a lost executor
    waiting.appendleft(requeued)
    waiting.remove(requeued)
    order.forget(waiting, requeued)
    assert [(q.name, q.queue_tag) for q in waiting] == [("c.1", 10), ("a.2", 10)]


def test_random_places_aborts_and_admissions_keep_the_queue_in_tag_order():
    rng = random.Random(7)
    order, waiting = TenantOrder(), deque[Queued]()
    for step in range(3000):
        action = rng.random()
        if action < 0.5 or not waiting:
            order.place(waiting, Queued(rng.choice("abc"), f"q{step}", end_len=rng.randint(1, 50)))
        elif action < 0.75:
            gone = rng.choice(list(waiting))
            waiting.remove(gone)
            order.forget(waiting, gone)
        else:
            _admit(order, waiting, rng.choice(list(waiting)[:3]).name)
        tags = [q.queue_tag for q in waiting]
        assert tags == sorted(tags) and all(tag >= 0 for tag in tags)


def _admit(order: TenantOrder, waiting: deque[Queued], *names: str) -> None:
    """Admit these (from anywhere in the queue: past a head waiting for pages too), then settle the clock."""
    for name in names:
        (queued,) = [q for q in waiting if q.name == name]
        waiting.remove(queued)
        order.admitted(queued)
    order.settle(waiting)


def test_the_clock_moves_with_admission_and_an_idle_tenant_saves_no_turns():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, "a.1", "a.2", "a.3", "a.4")
    _admit(order, waiting, "a.1", "a.2", "a.3")
    assert order.clock == 3
    # b was idle while a's first three ran: it starts at the clock, level with a's next, with no turns saved up
    _queue(order, waiting, "b.1", "b.2", "b.3")
    assert _names(waiting) == ["a.4", "b.1", "b.2", "b.3"]
    _queue(order, waiting, "a.5")
    assert _names(waiting) == ["a.4", "b.1", "b.2", "a.5", "b.3"]
    _admit(order, waiting, "a.4", "b.1", "b.2", "a.5", "b.3")
    assert order.clock == 6  # nothing waits: the last tag admitted


def test_requests_admitted_past_a_head_waiting_for_pages_do_not_move_the_clock():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, *(f"a.{i}" for i in range(1, 7)))
    _admit(order, waiting, "a.2", "a.3", "a.4")  # past a.1, which waits for pages
    assert order.clock == 0
    _queue(order, waiting, "b.1")
    assert _names(waiting) == ["a.1", "b.1", "a.5", "a.6"]


def test_a_tenant_is_not_charged_turns_its_aborted_requests_never_took():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, *(f"a.{i}" for i in range(1, 31)))
    for queued in list(waiting):  # its clients went away
        waiting.remove(queued)
        order.forget(waiting, queued)
    _queue(order, waiting, *(f"b.{i}" for i in range(1, 11)), "a.31")
    assert _names(waiting)[:3] == ["b.1", "a.31", "b.2"]
    # one aborted from the middle of a tenant's requests: the tenant's later ones move up by its cost
    _queue(order, waiting, "a.32", "a.33")
    (middle,) = [q for q in waiting if q.name == "a.32"]
    waiting.remove(middle)
    order.forget(waiting, middle)
    _queue(order, waiting, "a.34")
    assert [q.queue_tag for q in waiting if q.tenant == "a"] == [0, 1, 2]
    assert [q.queue_tag for q in waiting] == sorted(q.queue_tag for q in waiting)


def test_tenants_behind_the_clock_are_forgotten_past_the_prune_limit():
    order, waiting = TenantOrder(), deque[Queued]()
    _queue(order, waiting, *(f"t{i}.1" for i in range(1100)))
    _admit(order, waiting, *(q.name for q in list(waiting)))
    assert order.clock == 1 and not order._last  # every tenant's tag is at the clock: none remembered


def test_the_scheduler_admits_tenants_in_turns():
    """Room for one request at a time (its pages): the tenant queued behind another's five runs second."""
    scheduler = state_scheduler(0)
    scheduler.pages.allocate(scheduler.pages.free_count - 4)  # 16 tokens of pages: one request at a time
    flood = [Request(f"a{i}", [5, 6, 7, 8, 9], max_tokens=8, tenant="a") for i in range(5)]
    late = Request("b0", [5, 6, 7, 8, 9], max_tokens=8, tenant="b")
    for request in [*flood, late]:
        scheduler.add(request)
    finished, seq = [], 0
    while not scheduler.idle:
        step = scheduler.plan(seq)
        assert step is not None
        prefill = np.array([20 if c.sample_slot else -1 for c in step.prefill], np.int32)
        for request, _, _ in scheduler.commit(seq, np.full(len(step.rows), 20, np.int32), prefill):
            if request.finish is not None:
                finished.append(request.request_id)
        seq += 1
    assert finished == ["a0", "b0", "a1", "a2", "a3", "a4"]


def test_the_scheduler_forgets_the_turns_of_requests_aborted_while_waiting():
    scheduler = state_scheduler(0)
    gone = [Request(f"a{i}", [5, 6, 7], max_tokens=2, tenant="a") for i in range(3)]
    for request in gone:
        scheduler.add(request)
    for request in gone:
        scheduler.abort(request)
    for request in [Request(f"b{i}", [5, 6, 7], max_tokens=2, tenant="b") for i in range(2)]:
        scheduler.add(request)
    scheduler.add(Request("a3", [5, 6, 7], max_tokens=2, tenant="a"))
    assert [r.request_id for r in scheduler.waiting] == ["b0", "a3", "b1"]
