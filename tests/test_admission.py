"""Admission order (admission.py): a head waiting for pages lets later requests pass, a bounded number of times;
and the prefill budget by device (config.py)."""

from __future__ import annotations

from collections import deque

import pytest

from planner_svc.admission import Admission
from planner_svc.config import SchedulingConfig
from planner_svc.requests import Phase, Request
from tests.test_scheduler import make_scheduler


def take(admission, waiting, free):
    """Admit in order while `free` (pages) lasts; each request's size is its value."""
    left = [free]

    def fits(size):
        return size <= left[0]

    taken = []
    for size in admission.take(waiting, fits):
        left[0] -= size
        taken.append(size)
    return taken


def test_requests_that_free_what_the_head_waits_for_pass_it_past_the_count():
    admission = Admission(skip_limit=0)
    waiting = deque([10, 2, 3, 4])
    assert list(admission.take(waiting, lambda size: size < 10)) == []  # the head blocks: nothing passes
    passed = list(admission.take(waiting, lambda size: size < 10, frees_head=lambda size: size % 2 == 0))
    assert passed == [2, 4] and list(waiting) == [10, 3]


def test_later_requests_pass_a_blocked_head_a_bounded_number_of_times():
    admission = Admission(skip_limit=3)
    waiting = deque([10, 1, 2, 1, 1, 1])
    assert take(admission, waiting, free=4) == [1, 2, 1]
    assert list(waiting) == [10, 1, 1]
    assert take(admission, waiting, free=4) == []  # three passed it: the head blocks
    assert take(admission, waiting, free=11) == [10, 1]  # its pages free: it goes, the count resets
    assert admission.skipped == 0


def test_a_head_that_fits_goes_first_and_zero_skips_is_strict_fifo():
    assert take(Admission(skip_limit=5), deque([2, 1]), free=3) == [2, 1]
    assert take(Admission(skip_limit=0), deque([5, 1]), free=3) == []


def test_an_aborted_head_resets_the_count():
    admission = Admission(skip_limit=1)
    waiting = deque([10, 1, 1])
    assert take(admission, waiting, free=2) == [1]
    admission.forget(waiting.popleft())
    assert take(admission, waiting, free=2) == [1]


def test_a_small_request_is_not_held_behind_requests_waiting_for_pages():
    """Issue 14 case 8: long requests fill the pool, one more waits; a 4-token request still runs."""
    scheduler = make_scheduler(pool_pages=50, max_seq_len=64, budget=64)  # 16 pages of 4 a long request
    longs = [Request(f"long{i}", [5] * 4, 60) for i in range(4)]
    for request in longs:
        scheduler.add(request)
    small = Request("small", [5] * 4, 1)
    scheduler.add(small)
    scheduler.plan(0)
    assert [r.phase is Phase.WAITING for r in longs] == [False, False, False, True]
    assert small.phase is not Phase.WAITING and scheduler.admission.skipped == 1
    assert scheduler.blocked()  # the head still waits (and KV pressure relief is asked for)


def test_prefill_budget_by_device_unless_given():
    assert SchedulingConfig().for_device("cpu").prefill_token_budget == 256
    assert SchedulingConfig().for_device("cuda:0").prefill_token_budget == 8192
    assert SchedulingConfig(prefill_token_budget=512).for_device("cpu").prefill_token_budget == 512
    assert SchedulingConfig().token_budget == 8192
    # decode steps a plan: four on a CPU, one on a GPU, unless given
    assert [SchedulingConfig().for_device(d).steps_per_plan for d in ("cpu", "cuda:0")] == [4, 1]
    assert SchedulingConfig(decode_steps=2).for_device("cpu").steps_per_plan == 2
    assert SchedulingConfig().steps_per_plan == 1
    with pytest.raises(ValueError, match=r"decode_steps must be in \[1, 16\]"):
        SchedulingConfig(decode_steps=17)
    with pytest.raises(ValueError, match="admission_skips"):
        SchedulingConfig(admission_skips=-1)
