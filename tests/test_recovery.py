"""After an executor is lost or refuses a plan, the host truth is rebuilt (planner_svc/recovery.py): who is
cut, who runs again, nothing leaks, and the next steps write every row whole, matching a device that
lost its tables (or kept them)."""

from __future__ import annotations

import random

import numpy as np

from planner_svc.config import SchedulingConfig
from planner_svc.conversations import Conversations
from planner_svc.planned import SchedulerConfig
from planner_svc.recovery import recover
from planner_svc.requests import Finish, Phase, Request, Sampling
from planner_svc.retention import RetentionConfig
from planner_svc.scheduler import Scheduler
from protos.layout import RowLayout
from tests.test_scheduler import PAGE, DeviceRows, make_scheduler


def req(i: int, prompt_len: int = 10, max_tokens: int = 8) -> Request:
    return Request(f"r{i}", list(range(1, prompt_len + 1)), max_tokens, Sampling())


class Loop:
    """Plans two deep and commits one step late against a device copy, checking every read row."""

    def __init__(self, scheduler, seed: int = 0):
        self.scheduler, self.device, self.rng = scheduler, DeviceRows(scheduler.layout), random.Random(seed)
        self.pending: list = []
        self.seq = 0

    def plan(self) -> bool:
        step = self.scheduler.plan(self.seq)
        if step is None:
            return False
        read = self.device.apply(step)
        if step.bucket:
            assert read.tobytes() == step.mirror, "device rows differ from the planner's mirror"
        self.pending.append(step)
        self.seq += 1
        return True

    def commit(self) -> None:
        step = self.pending.pop(0)
        tokens = np.array([self.rng.randrange(3, 100) for _ in range(step.bucket)], dtype=np.int32)
        prefill = np.array(
            [self.rng.randrange(3, 100) if c.sample_slot else -1 for c in step.prefill], dtype=np.int32
        )
        self.scheduler.commit(step.seq, tokens, prefill)
        self.scheduler.slots.check()
        self.scheduler.pages.check()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if len(self.pending) >= 2:
                self.commit()
            if not self.plan():
                if not self.pending:
                    return
                self.commit()

    def drain(self) -> None:
        self.run(10_000)
        while self.pending:
            self.commit()


def started(scheduler, loop: Loop, requests: list[Request], steps: int) -> None:
    for request in requests:
        scheduler.add(request)
    loop.run(steps)
    assert len(loop.pending) == 2  # two plans in flight when the stream ends


def test_lost_executor_cuts_what_streamed_requeues_the_rest_and_frees_everything():
    scheduler = make_scheduler(pool_pages=64, budget=16)
    loop = Loop(scheduler)
    early = [req(i, max_tokens=20) for i in range(3)]
    started(scheduler, loop, early, 6)
    late = [req(10 + i, prompt_len=12) for i in range(2)]
    for request in late:
        scheduler.add(request)
    loop.plan()  # a step reading the late prompts is in flight, never to be answered
    assert all(r.output_ids for r in early) and not any(r.output_ids for r in late)

    result = recover(scheduler, last_seq=loop.seq - 1, refused_seq=None, reason="gone")
    loop.pending.clear()
    assert set(result.cut) == set(early) and set(result.requeued) == set(late)
    assert all(r.finish is Finish.ABORT for r in early)
    assert list(scheduler.waiting) == late and all(r.phase is Phase.WAITING and not r.pages for r in late)
    assert scheduler.pages.free_count == scheduler.pages.total and scheduler.slots.held_count == 0
    scheduler.slots.check()

    loop.device = DeviceRows(scheduler.layout)  # a restarted executor: zero tables
    loop.drain()
    assert all(r.finish is not None and r.finish is not Finish.ABORT for r in late)
    assert all(len(r.output_ids) == r.max_tokens for r in late)
    assert scheduler.idle and scheduler.pages.free_count == scheduler.pages.total


def test_refused_step_fails_the_request_it_carried_and_the_others_go_on_with_rows_written_whole():
    scheduler = make_scheduler(pool_pages=64, budget=16)
    loop = Loop(scheduler, seed=1)
    running = [req(i, max_tokens=30) for i in range(3)]
    started(scheduler, loop, running, 8)
    while loop.pending:
        loop.commit()
    bad, waiting = req(9, prompt_len=6), req(10, prompt_len=5)
    scheduler.add(bad)
    loop.plan()  # bad's prompt and the running rows: the step the executor refuses
    scheduler.add(waiting)
    loop.plan()  # planned behind it: never run
    refused_seq = loop.pending[0].seq
    assert {c.request for c in loop.pending[0].prefill} == {bad} and set(loop.pending[0].rows) == set(running)
    before = {r: len(r.output_ids) for r in running}

    result = recover(scheduler, last_seq=loop.seq - 1, refused_seq=refused_seq)
    loop.pending.clear()
    assert result.refused == [bad] and bad.finish is Finish.ABORT and not result.cut
    assert result.requeued == [waiting] and waiting.phase is Phase.PREFILL and waiting.pages
    assert all(r.stale and r.kv_len == r.prompt_len + len(r.output_ids) - 1 for r in running)
    # The executor kept its KV; its new stream starts from zero tables (executor_svc/server.py Steps),
    # and the survivors' rows are written whole with their last token.
    loop.device = DeviceRows(scheduler.layout)
    loop.drain()
    assert waiting.finish is Finish.LENGTH and len(waiting.output_ids) == waiting.max_tokens
    for request in running:
        assert request.finish is Finish.LENGTH and len(request.output_ids) == 30 > before[request]
    assert scheduler.idle and scheduler.pages.free_count == scheduler.pages.total


def test_a_refused_step_takes_back_what_the_steps_that_never_ran_claimed():
    """Their prompt chunks' progress (what a turn's conversation would keep) and the full pages they put in
    the prefix index: no KV was written for either, so no later prompt may take those pages."""
    scheduler = make_scheduler(pool_pages=64, budget=8)
    loop = Loop(scheduler)
    bad = req(9, prompt_len=20)
    scheduler.add(bad)
    loop.plan()  # tokens [0, 8): run and committed
    loop.commit()
    loop.plan()  # [8, 16): the step the executor refuses
    loop.plan()  # [16, 20): planned behind it
    refused_seq = loop.pending[0].seq
    hashes = bad.prefix_hashes(16, PAGE)
    assert bad.prefilled == 20 and len(scheduler.pages.match_prefix(hashes)) == 4
    scheduler.pages.free(bad.pages[:4])  # the refs match_prefix took for the check above

    result = recover(scheduler, last_seq=loop.seq - 1, refused_seq=refused_seq)
    assert result.refused == [bad] and bad.prefilled == 8
    assert scheduler.pages.match_prefix(hashes) == scheduler.pages.match_prefix(hashes[:2])  # [0, 8) stays
    scheduler.pages.check()


def test_refused_steady_step_fails_its_rows():
    """A repeated step carries only its seq and bucket: nothing to blame but its rows."""
    scheduler = make_scheduler(pool_pages=64, budget=16)
    loop = Loop(scheduler, seed=2)
    running = [req(i, max_tokens=30) for i in range(2)]
    started(scheduler, loop, running, 8)
    assert not loop.pending[0].prefill and loop.pending[0].sampler is None
    result = recover(scheduler, last_seq=loop.seq - 1, refused_seq=loop.pending[0].seq)
    assert set(result.refused) == set(running) and scheduler.idle
    assert scheduler.pages.free_count == scheduler.pages.total and scheduler.slots.held_count == 0


def test_lost_executor_loses_resident_conversations_and_keeps_parked_ones():
    scheduler = make_scheduler(pool_pages=64)
    conversations = Conversations(PAGE, RetentionConfig())
    scheduler.conversations = conversations
    loop = Loop(scheduler)
    resident = conversations.open("t", "resident")
    parked = conversations.open("t", "parked")
    parked.parked, parked.tokens = True, [1, 2, 3]
    turn = req(1, prompt_len=10, max_tokens=3)
    mount, _ = conversations.mount(resident, turn.prompt_ids)
    turn.conversation = resident
    scheduler.add(turn)
    loop.drain()
    assert resident.pages and not resident.busy

    result = recover(scheduler, last_seq=loop.seq - 1, refused_seq=None, reason="its KV was lost")
    assert result.conversations_lost == 1 and not resident.pages and not resident.tokens
    assert parked.parked and parked.tokens == [1, 2, 3]
    assert scheduler.pages.free_count == scheduler.pages.total
    again, release = conversations.mount(resident, turn.prompt_ids + [50, 51])
    assert again.reused == 0 and not release and again.checkpoint == "none (its KV was lost)"


def test_a_request_whose_pages_were_freed_behind_its_back_fails_alone_in_a_lost_recovery():
    """The incident's shape: a request holds pages the pool already counts free; recovering from a loss must
    not raise out of the engine's loop, but fail that request and cut or requeue the others as ever."""
    scheduler = make_scheduler(pool_pages=64, budget=16)
    loop = Loop(scheduler, seed=3)
    running = [req(i, max_tokens=20) for i in range(3)]
    started(scheduler, loop, running, 6)
    broken = running[1]
    scheduler.pages.free(broken.pages)  # a planner defect: its pages freed twice once it is cut

    result = recover(scheduler, last_seq=loop.seq - 1, refused_seq=None, reason="gone")
    assert [(r, type(e)) for r, e in result.failed] == [(broken, ValueError)]
    assert "freed 1 times with refcount 0" in str(result.failed[0][1])
    assert set(result.cut) == {running[0], running[2]} and not result.requeued
    assert all(r.finish is Finish.ABORT and r.phase is Phase.DONE and not r.pages for r in running)
    assert all(r.released for r in running)  # none left for a waiter of its end (a pin's report) to wait on
    scheduler.pages.check()
    assert scheduler.pages.free_count == scheduler.pages.total and scheduler.idle  # rebuilt: nothing leaks


def test_a_refused_recovery_fails_the_broken_request_alone_and_the_others_go_on():
    """The refused request's pages were freed behind its back (a stale free, as after a loss): failing it raises,
    so it fails as broken (INTERNAL all the same), and the others go on to their ends."""
    scheduler = make_scheduler(pool_pages=64, budget=16)
    loop = Loop(scheduler, seed=4)
    running = [req(i, max_tokens=30) for i in range(2)]
    started(scheduler, loop, running, 8)
    while loop.pending:
        loop.commit()
    bad = req(9, prompt_len=6)
    scheduler.add(bad)
    loop.plan()  # bad's prompt and the running rows: the step the executor refuses
    scheduler.pages.free(bad.pages)

    result = recover(scheduler, last_seq=loop.seq - 1, refused_seq=loop.pending[0].seq)
    loop.pending.clear()
    assert [r for r, _ in result.failed] == [bad] and not result.refused and not result.cut
    assert bad.finish is Finish.ABORT and bad.phase is Phase.DONE and not bad.pages
    scheduler.pages.check()
    loop.device = DeviceRows(scheduler.layout)
    loop.drain()
    assert all(r.finish is Finish.LENGTH and len(r.output_ids) == 30 for r in running)
    assert scheduler.idle and scheduler.pages.free_count == scheduler.pages.total


def test_a_loan_out_across_a_loss_stays_out_of_the_rebuilt_pools_until_given_back():
    scheduler = make_scheduler(pool_pages=16)
    pages = scheduler.take_pages(3)
    assert pages is not None
    loan = scheduler.loans.lend(pages, [])
    scheduler.add(req(1, prompt_len=10, max_tokens=4))
    Loop(scheduler).run(2)

    recover(scheduler, last_seq=10, refused_seq=None, reason="gone")
    assert scheduler.loans.stale(loan)
    assert [scheduler.pages.refcount(p) for p in pages] == [1, 1, 1]
    assert scheduler.pages.free_count == scheduler.pages.total - 3
    scheduler.loans.end(loan)
    scheduler.return_pages(loan.pages)
    scheduler.pages.check()
    assert scheduler.pages.free_count == scheduler.pages.total
    assert not scheduler.loans.stale(scheduler.loans.lend([], []))  # a loan of the new epoch


def test_a_turn_that_stopped_keeps_no_checkpoint_of_its_refused_run_after_the_stop():
    """Hybrid: a turn retires with its length counting the step planned after its stop. That step refused (it
    never ran), the conversation's checkpoint and state copy sit where the KV and the state end, not a token
    past them, where the next turn would mount a position whose KV no step wrote."""
    conversations = Conversations(4, RetentionConfig())
    config = SchedulerConfig(
        page_size=4,
        pool_pages=32,
        buckets=(1, 2),
        max_seq_len=64,
        vocab_size=100,
        state_slots=4,
        settings=SchedulingConfig(prefill_token_budget=64),
    )
    scheduler = Scheduler(config, RowLayout.build([1, 2], 64, 4, 32), conversations)
    conversation = conversations.open("t", "chat")
    prompt = [5, 6, 7, 8, 9]
    turn = Request("turn", prompt, 8, Sampling(), stop_ids=frozenset({99}), tenant="t")
    conversations.mount(conversation, prompt)
    turn.conversation = conversation
    scheduler.add(turn)
    scheduler.plan(0)  # the prompt
    scheduler.commit(0, np.zeros(0, np.int32), np.array([11], np.int32))
    scheduler.plan(1)
    scheduler.plan(2)  # the run after the stop sampled in step 1
    scheduler.commit(1, np.array([99], np.int32), np.zeros(0, np.int32))
    assert turn.finish is Finish.STOP

    recover(scheduler, last_seq=2, refused_seq=2)
    assert max(conversation.states) == 6  # positions 0-5 written, the state read those 6 tokens
    assert conversation.retention.positions[-1] == 6


def test_a_lost_executor_puts_the_queue_back_in_tenant_order():
    """Requests admitted past a head waiting for pages come back behind it: the queue stays ordered by tag, as
    tenant_order places into it (they went first, and the head to the back)."""
    scheduler = make_scheduler(pool_pages=16, budget=16)  # 15 pages of 4 tokens
    loop = Loop(scheduler)
    running = req(0, prompt_len=10, max_tokens=20)  # 8 pages
    started(scheduler, loop, [running], 4)
    big = req(1, prompt_len=20, max_tokens=20)  # 10 pages: waits for the running one's
    small = req(2, prompt_len=4, max_tokens=4)  # 2 pages: admitted past it
    scheduler.add(big)
    scheduler.add(small)
    loop.plan()  # a step reading the small prompt, never to be answered
    assert list(scheduler.waiting) == [big] and small.phase is not Phase.WAITING and not small.output_ids

    recover(scheduler, last_seq=loop.seq - 1, refused_seq=None, reason="gone")
    loop.pending.clear()
    assert list(scheduler.waiting) == [big, small]
    assert [r.queue_tag for r in scheduler.waiting] == sorted(r.queue_tag for r in scheduler.waiting)
