"""The scheduler's plans, applied to a numpy copy of the device rows, describe every request exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from planner_svc.config import SchedulingConfig
from planner_svc.planned import CapacityError
from planner_svc.requests import Finish, Request, Sampling
from planner_svc.scheduler import Scheduler, SchedulerConfig
from protos.layout import RowLayout
from protos.wire import unpack_i32

PAGE = 4


def make_scheduler(
    pool_pages=64, buckets=(1, 2, 4), max_seq_len=64, budget=16, row_check=True, decode_steps=None
):
    settings = SchedulingConfig(prefill_token_budget=budget, row_check=row_check, decode_steps=decode_steps)
    config = SchedulerConfig(
        page_size=PAGE,
        pool_pages=pool_pages,
        buckets=buckets,
        max_seq_len=max_seq_len,
        vocab_size=100,
        settings=settings,
    )
    return Scheduler(config, RowLayout.build(list(buckets), max_seq_len, PAGE, pool_pages))


class DeviceRows:
    """What an executor does with a plan's bytes (DESIGN §3), independent of the planner's mirror."""

    def __init__(self, layout: RowLayout):
        self.rows = np.zeros((layout.slots, layout.columns), dtype=np.int32)
        self.slots = np.zeros(0, dtype=np.int32)

    def apply(self, step) -> np.ndarray:
        flat = self.rows.reshape(-1)
        if step.delta.slots:
            self.slots = unpack_i32(step.delta.slots).copy()
        runs = unpack_i32(step.delta.row_runs)
        i = 0
        while i < len(runs):
            slot, col, n = runs[i : i + 3]
            start = slot * self.rows.shape[1] + col
            flat[start : start + n] = runs[i + 3 : i + 3 + n]
            i += 3 + n
        read = self.rows[self.slots].copy() if step.bucket else None
        if step.bucket:
            real = self.slots[self.slots != 0]
            self.rows[real, RowLayout.KV_LEN] += step.steps
        return read


def run_steps(scheduler, device, steps, rng, on_step=None, inflight=2):
    """Plans two deep, commits one step late, answers each row with a random token."""
    pending = []
    seq = 0
    for _ in range(steps):
        if len(pending) >= inflight:
            commit(scheduler, pending.pop(0), rng)
        step = scheduler.plan(seq)
        if step is None:
            if not pending:
                return seq
            commit(scheduler, pending.pop(0), rng)
            continue
        read = device.apply(step)
        check_rows(scheduler, step, read)
        assert not device.rows[0].any(), "the sink row must stay zero"
        if on_step:
            on_step(seq)
        pending.append(step)
        seq += 1
    while pending:
        commit(scheduler, pending.pop(0), rng)
    return seq


DECODE_STEPS: dict = {}  # request -> decode steps it was planned in so far


def check_rows(scheduler, step, read):
    if not step.bucket:
        return
    assert read.tobytes() == step.mirror, "device rows differ from the planner's mirror"
    for row, request in enumerate(step.rows):
        cells = read[row]
        kv_len = int(cells[RowLayout.KV_LEN])
        assert kv_len == request.prompt_len + DECODE_STEPS.get(request, 0)
        DECODE_STEPS[request] = DECODE_STEPS.get(request, 0) + 1
        pages = -(-(kv_len + 1) // PAGE)
        assert list(cells[RowLayout.BLOCK_TABLE : RowLayout.BLOCK_TABLE + pages]) == request.pages[:pages]
        assert 0 not in request.pages[:pages]


def commit(scheduler, step, rng):
    tokens = np.array([rng.randrange(3, 100) for _ in range(step.bucket)], dtype=np.int32)
    prefill = np.array([rng.randrange(3, 100) if c.sample_slot else -1 for c in step.prefill], dtype=np.int32)
    scheduler.commit(step.seq, tokens, prefill)
    scheduler.slots.check()
    scheduler.pages.check()


def req(i, prompt_len=10, max_tokens=8, stops=frozenset()):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), max_tokens, Sampling(), stops)


def test_steady_step_sends_only_seq_and_bucket():
    scheduler = make_scheduler(buckets=(1, 2, 4))
    device = DeviceRows(scheduler.layout)
    requests = [req(i, prompt_len=5, max_tokens=20) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    steps = []
    rng = random.Random(0)
    pending = []
    for seq in range(12):
        if len(pending) >= 2:
            commit(scheduler, pending.pop(0), rng)
        step = scheduler.plan(seq)
        device.apply(step)
        steps.append(step)
        pending.append(step)
    # step 0: prefill; step 1: rows written whole, one run each (one pool), holding every page the
    # request can write; later steps cross pages (lengths 6..16 on pages of 4) and send nothing but seq and bucket
    assert steps[0].prefill and not steps[0].bucket
    first = steps[1]
    assert len(unpack_i32(first.delta.slots)) == 4
    runs = unpack_i32(first.delta.row_runs)
    assert runs[2] == RowLayout.NARROW + requests[0].pages_needed(PAGE) == RowLayout.NARROW + 6
    assert all(not (s.delta.slots or s.delta.row_runs or s.sampler or s.prefill) for s in steps[2:])
    assert all(s.rows == first.rows for s in steps[2:])


def test_steady_repeats_run_several_steps_and_end_each_request_where_it_stops():
    scheduler = make_scheduler(row_check=False, decode_steps=4)
    device = DeviceRows(scheduler.layout)
    long, stopped = req(0, prompt_len=5, max_tokens=10), req(1, prompt_len=5, max_tokens=20, stops={50})
    for r in (long, stopped):
        scheduler.add(r)
    made: dict = {long: 0, stopped: 0}  # decode tokens the device sampled for each, dropped ones included
    plans, pending, seq = [], [], 0

    def commit_sampled(step):
        tokens = np.zeros((step.steps, step.bucket), dtype=np.int32)
        for i in range(step.steps):
            for row, request in enumerate(step.rows):
                made[request] += 1
                tokens[i, row] = 50 if request is stopped and made[request] == 4 else 7
        prefill = np.array([7 if c.sample_slot else -1 for c in step.prefill], dtype=np.int32)
        scheduler.commit(step.seq, tokens.reshape(-1), prefill)

    while (step := scheduler.plan(seq)) is not None or pending:
        if step is None:
            commit_sampled(pending.pop(0))
            continue
        device.apply(step)
        for request in step.rows:  # no row is stored past its end
            assert device.rows[scheduler.slots.slot_of(request), RowLayout.KV_LEN] <= request.end_len
        plans.append(step)
        pending.append(step)
        seq += 1
        if len(pending) == 2:
            commit_sampled(pending.pop(0))
    assert (long.finish, len(long.output_ids)) == (Finish.LENGTH, 10)
    # its prompt's token, then the fourth decode token stops it; the rest of that plan's tokens are dropped
    assert (stopped.finish, stopped.output_ids[-1], len(stopped.output_ids)) == (Finish.STOP, 50, 5)
    assert made[stopped] > 4
    several = [p for p in plans if p.steps > 1]
    assert several and all(p.steps <= 4 for p in plans)
    assert all(not (p.delta.slots or p.delta.row_runs or p.sampler or p.prefill) for p in several)
    assert scheduler.idle


def test_new_row_of_one_pool_model_is_one_run():
    scheduler = make_scheduler(buckets=(1,))
    device = DeviceRows(scheduler.layout)
    scheduler.add(req(0, prompt_len=9))
    scheduler.plan(0)  # prefill
    step = scheduler.plan(1)
    runs = unpack_i32(step.delta.row_runs)
    assert runs[1] == 0 and len(runs) == 3 + runs[2]  # one run from column 0
    device.apply(step)


def unshared(i, prompt_len):
    """A request whose prompt shares no page with req's or another unshared's."""
    return Request(f"r{i}", [20 * i + t for t in range(prompt_len)], 8, Sampling())


def test_prompts_arriving_while_a_prefill_runs_wait_for_the_next_step_together():
    scheduler = make_scheduler(budget=16)
    rng = random.Random(0)
    scheduler.add(req(0, prompt_len=10))
    first = scheduler.plan(0)
    assert [c.request.request_id for c in first.prefill] == ["r0"]
    scheduler.add(unshared(1, 6))
    held = scheduler.plan(1)  # r0 can decode; r1's 6 tokens would not fill a step: they wait for step 0
    assert not held.prefill and [r.request_id for r in held.rows] == ["r0"]
    commit(scheduler, first, rng)
    scheduler.add(unshared(2, 8))
    joined = scheduler.plan(2)  # step 0 done: the prompts at hand go together
    assert [(c.request.request_id, len(c.token_ids) // 4) for c in joined.prefill] == [("r1", 6), ("r2", 8)]


def test_prompts_do_not_wait_when_they_fill_a_step_or_nothing_else_can_run():
    scheduler = make_scheduler(budget=16)
    scheduler.add(req(0, prompt_len=10))
    scheduler.plan(0)
    for i in (1, 2):
        scheduler.add(unshared(i, 9))
    full = scheduler.plan(1)  # 18 tokens at hand fill the 16 of a step
    assert [c.request.request_id for c in full.prefill] == ["r1", "r2"]
    alone = make_scheduler(budget=16)
    alone.add(req(0, prompt_len=30))
    alone.plan(0)
    rest = alone.plan(1)  # no row decodes: the prompt's rest runs at once rather than leave the GPU idle
    assert [(c.request.request_id, c.start) for c in rest.prefill] == [("r0", 16)]


def test_prompts_do_not_wait_for_rows_that_cannot_decode():
    scheduler = make_scheduler(budget=16)
    rng = random.Random(0)
    scheduler.add(Request("a", [1, 2, 3, 4, 5, 6], 1, Sampling()))  # its one token comes from its prefill
    first = scheduler.plan(0)
    scheduler.add(unshared(1, 6))
    assert [c.request.request_id for c in scheduler.plan(1).prefill] == ["r1"]  # no row decodes meanwhile
    commit(scheduler, first, rng)


def test_capacity_and_bad_input_change_nothing():
    scheduler = make_scheduler(pool_pages=8)
    with pytest.raises(CapacityError, match="needs 10 KV pages and the pool has 7"):
        scheduler.add(req(0, prompt_len=30, max_tokens=11))
    with pytest.raises(ValueError, match="context is 64"):
        scheduler.add(req(1, prompt_len=64))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scheduler.add(Request("x", [1, 500], 4))
    assert not scheduler.waiting and scheduler.pages.free_count == 7


def test_max_tokens_is_clamped_to_the_context():
    scheduler = make_scheduler(max_seq_len=64)
    r = req(0, prompt_len=60, max_tokens=100)
    scheduler.add(r)
    assert r.max_tokens == 5


@pytest.mark.parametrize("pool_pages", [40, 400], ids=["kv-pressure", "slot-pressure"])
@pytest.mark.parametrize("seed", range(3))
def test_soak_kv_and_slot_pressure(seed, pool_pages):
    """More requests than slots and pages; aborts, stops and chunked prefill mixed in; rows stay exact."""
    rng = random.Random(seed)
    scheduler = make_scheduler(pool_pages=pool_pages, buckets=(1, 2, 4), budget=12)
    device = DeviceRows(scheduler.layout)
    requests = []

    def on_step(seq):
        if seq % 3 == 0 and len(requests) < 60:
            r = req(
                len(requests),
                prompt_len=rng.randrange(1, 30),
                max_tokens=rng.randrange(1, 25),
                stops=frozenset({rng.randrange(3, 100)}),
            )
            scheduler.add(r)
            requests.append(r)
        if rng.random() < 0.05 and requests:
            scheduler.abort(rng.choice(requests))

    for i in range(12):
        r = req(i, prompt_len=rng.randrange(1, 30), max_tokens=rng.randrange(1, 25))
        scheduler.add(r)
        requests.append(r)
    displaced = []
    original = scheduler.slots.assign

    def counting_assign(seq, ids):
        assignment = original(seq, ids)
        displaced.extend(assignment.displaced)
        return assignment

    scheduler.slots.assign = counting_assign
    steps = run_steps(scheduler, device, 3000, rng, on_step)
    assert steps > 100
    assert len(displaced) > 10 if pool_pages > 100 else scheduler.pages.total < 60
    for r in requests:
        assert r.finish is not None, f"{r.request_id} never finished"
        if r.finish is Finish.LENGTH:
            assert len(r.output_ids) == r.max_tokens
        if r.finish is Finish.STOP:
            assert r.output_ids[-1] in r.stop_ids
    assert scheduler.pages.free_count == scheduler.pages.total
    assert scheduler.slots.free_count == scheduler.slots.num_slots - 1


def test_steady_message_size_does_not_grow_with_the_batch():
    from planner_svc.step_wire import to_proto

    sizes = {}
    for rows in (1, 16, 64):
        scheduler = make_scheduler(
            pool_pages=rows * 20 + 1, buckets=(1, 16, 64), max_seq_len=80, budget=4096, row_check=False
        )
        for i in range(rows):
            scheduler.add(
                req(i, prompt_len=5 + i % PAGE, max_tokens=60)
            )  # staggered: some row crosses every step
        rng, pending, steady = random.Random(0), [], []
        for seq in range(12):
            if len(pending) >= 2:
                commit(scheduler, pending.pop(0), rng)
            step = scheduler.plan(seq)
            pending.append(step)
            message = to_proto(step)
            if step.bucket and not (message.slots or message.row_runs or message.prefill):
                steady.append(message.ByteSize())
        sizes[rows] = max(steady)
    assert sizes[1] == sizes[16] == sizes[64] <= 8, sizes


def test_prefix_pages_another_request_holds_cost_no_free_page_at_admission():
    """B's prompt shares two full pages with A, which holds them: B needs two new pages of its four, and three
    are free, so B is let in beside A. Admission used to ask four free pages and keep B waiting (the planner
    then relieved conversations to make room for nothing)."""
    config = SchedulerConfig(
        page_size=4,
        pool_pages=8,
        buckets=(1, 2),
        max_seq_len=32,
        vocab_size=100,
        settings=SchedulingConfig(prefill_token_budget=64, prefix_cache=True),
    )
    scheduler = Scheduler(config, RowLayout.build([1, 2], 32, 4, 8))  # 7 pages
    prompt = list(range(10, 22))  # 12 tokens: two full pages a match may take (one token is left to read)
    first = Request("a", prompt, 5, Sampling(), tenant="t")
    scheduler.add(first)
    scheduler.plan(0)
    scheduler.commit(0, np.zeros(0, np.int32), np.array([50], np.int32))
    assert scheduler.pages.free_count == 3  # A holds 4 pages
    second = Request("b", prompt, 5, Sampling(), tenant="t")
    scheduler.add(second)
    assert not scheduler.blocked()
    step = scheduler.plan(1)
    assert step is not None and [c.request for c in step.prefill] == [second] and second.reused == 8
    assert scheduler.pages.free_count == 1


def test_prefix_pages_are_shared_within_a_tenant_only():
    """The prefix hash chain is seeded by the tenant: B's identical prompt reuses none of A's pages."""
    config = SchedulerConfig(
        page_size=PAGE,
        pool_pages=64,
        buckets=(1, 2, 4),
        max_seq_len=64,
        vocab_size=100,
        settings=SchedulingConfig(prefill_token_budget=16, row_check=True, prefix_cache=True),
    )
    scheduler = Scheduler(config, RowLayout.build([1, 2, 4], 64, PAGE, 64))
    device, rng = DeviceRows(scheduler.layout), random.Random(0)
    prompt = list(range(1, 18))  # four full pages and one token
    reused, seq = {}, 0
    for name, tenant in (("a1", "a"), ("a2", "a"), ("b", "b"), ("open", "")):
        request = Request(name, prompt, 2, Sampling(), frozenset(), tenant=tenant)
        scheduler.add(request)
        while (step := scheduler.plan(seq)) is not None:  # one step at a time, each committed at once
            check_rows(scheduler, step, device.apply(step))
            commit(scheduler, step, rng)
            seq += 1
        assert request.finish is not None
        reused[name] = request.reused
    assert reused == {"a1": 0, "a2": 16, "b": 0, "open": 0}
