"""The host truth after an executor's step stream ended (DESIGN §7 invariant 7): which requests are cut,
which run again, and the tables rebuilt so the returning stream writes every row whole.

Two cases. The executor was *lost* (the stream broke, or it hung): its KV pool is gone with it, so every
page is garbage: requests that produced tokens are cut, the others start again from the queue, and every
conversation whose KV was only there forgets it (its next turn reads its prompt again). A plan was
*refused* (a planner defect; the executor lives and ran every step before it): the refused step's requests
fail, everyone else keeps their KV and goes on, their rows written whole on the new stream.

Pure logic: no gRPC, no asyncio.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from planner_svc.requests import Finish, Phase, Request
from planner_svc.scheduler import PlannedStep, Scheduler
from planner_svc.slots import SlotCache


@dataclass(slots=True)
class Recovery:
    cut: list[Request] = field(default_factory=list)  # had produced tokens: they end with an error
    refused: list[Request] = field(default_factory=list)  # in the refused step: they end with an error
    requeued: list[Request] = field(default_factory=list)  # had produced nothing: they run again
    # Whose host truth the recovery could not rebuild (a planner defect, raised): they end with an error
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    conversations_lost: int = 0  # conversations whose KV was only on the lost executor


def recover(
    scheduler: Scheduler, last_seq: int, refused_seq: int | None = None, reason: str = ""
) -> Recovery:
    """Every plan up to `last_seq` was made (sent or not: a send that failed counts); those after the last
    commit never finished (or never ran).

    `refused_seq` is the step the executor refused (its KV pool intact), None when the executor was lost;
    the requests whose data that step carried (`_carried`) fail, the others in it go on.
    Afterwards nothing is in flight, no slot is held, the mirror is zero, and every running request is
    stale: the next plan writes its row whole (with its last token) and the step numbers go on from
    `last_seq + 1`. The refused and cut requests are aborted (their pages and turns freed). A request whose
    part raises (a planner defect: pages freed twice) is `failed` alone (`_drop`); the others go on.
    """
    result = Recovery()
    lost = refused_seq is None
    refused_step = scheduler._steps.get(refused_seq) if refused_seq is not None else None
    unwritten: set[int] = set()
    if refused_step is not None:
        result.refused = [r for r in _carried(scheduler, refused_step) if r.finish is None]
        unwritten = _unplan(scheduler, [s for seq, s in scheduler._steps.items() if seq >= refused_step.seq])
    # No step in flight: whatever was planned after the last commit is forgotten, its reads and copies included.
    scheduler.marks.forget(scheduler.committed)
    scheduler._steps.clear()
    scheduler._steady, scheduler._steady_left = None, 0
    scheduler.committed = max(scheduler.committed, last_seq)
    scheduler.slots = SlotCache(scheduler.layout.widest_bucket)
    scheduler._assigned_seq = last_seq
    scheduler.mirror.reset()
    # Every page of the finished returns (their turns end), one request at a time so a defect has a name.
    for request in [r for r in scheduler._pending_free if r.last_seq <= scheduler.committed]:
        scheduler._pending_free.remove(request)
        _guarded(scheduler, result, request, scheduler._release_pages)
    for request in list(result.refused):
        _guarded(scheduler, result, request, lambda r: _fail_refused(scheduler, r))
    for request in [*scheduler.prefilling, *scheduler.decoding]:
        if request.output_ids and lost:
            result.cut.append(request)
            _guarded(scheduler, result, request, scheduler.abort)
        elif request.output_ids:  # its KV up to its last token's is on the device: it goes on
            request.kv_len = request.prompt_len + len(request.output_ids) - 1
            request.stale = True
        else:
            result.requeued.append(request)
            _read_again(scheduler, request, keep_pages=not lost, unwritten=unwritten)
    if lost:
        waiting = [r for r in scheduler.waiting if r not in result.requeued]
        for request in waiting:  # mounted pages are garbage too
            request.pages, request.reused, request.prefilled, request.state_source = [], 0, 0, 0
        scheduler.waiting.clear()
        # by tag, as tenant_order keeps it (stable: a requeued request goes first of equal tags)
        scheduler.waiting.extend(sorted([*result.requeued, *waiting], key=lambda r: r.queue_tag))
        result.conversations_lost = _forget_resident(scheduler, reason)
        lent_pages, lent_states = scheduler.loans.rebuilt()  # a restore still answering may still write them
        scheduler.pages.reset(keep=lent_pages)
        scheduler.states.reset(keep=lent_states)  # the recurrent states went with the pool (the copies above)
    scheduler.mark_stale()  # nothing left to mark after the above: every running row is stale already
    scheduler._dirty = True
    return result


def _guarded(
    scheduler: Scheduler, result: Recovery, request: Request, part: Callable[[Request], object]
) -> None:
    """One request's part of the recovery; should it raise, that request alone fails (`_drop`)."""
    try:
        part(request)
    except Exception as error:
        result.failed.append((request, error))
        for ending in (result.cut, result.refused):
            if request in ending:
                ending.remove(request)
        _drop(scheduler, request)


def _drop(scheduler: Scheduler, request: Request) -> None:
    """The request leaves the schedule holding nothing. Its pages and state slot, whatever they are, stay out
    of the pools (leaked until the pools are rebuilt) rather than be handed to a second owner; its turn ends,
    its conversation forgets what it kept."""
    for queue in (scheduler.waiting, scheduler.prefilling, scheduler.decoding, scheduler._pending_free):
        if request in queue:
            queue.remove(request)
    scheduler.slots.release(request)
    request.phase, request.pages, request.state_slot = Phase.DONE, [], 0
    request.released = True  # it holds nothing now: whoever waits for its end stops waiting
    if request.finish is None:
        request.finish = Finish.ABORT
    conversation = request.conversation
    if conversation is not None:
        conversation.pages, conversation.states = [], {}  # leaked with the request's, not given back
        conversation.forget()
        conversation.busy = False


def _fail_refused(scheduler: Scheduler, request: Request) -> None:
    if request.state_slot:  # its state may have read steps that never ran: no checkpoint of it
        scheduler.states.give_back(request.state_slot)
        request.state_slot = 0
    scheduler.abort(request)


def _carried(scheduler: Scheduler, step: PlannedStep) -> list[Request]:
    """The requests whose data a refused step carried: prompt chunks, and rows written whole (with their
    sampler state). Rows that only went on carry nothing to refuse; if none carried anything, all of it."""
    written = set(step.sampler.slots) if step.sampler is not None else set()
    carried = [chunk.request for chunk in step.prefill]
    carried += [r for r in step.rows if scheduler.slots.slot_of(r) in written]
    return list(dict.fromkeys(carried)) or list(step.rows)


def _unplan(scheduler: Scheduler, steps: list[PlannedStep]) -> set[int]:
    """What steps that never ran claimed, taken back: their prompt chunks' progress (a turn's conversation
    keeps only tokens whose KV was written), the decode steps a finished request's length counts (its run
    after its stop: its turn's checkpoint and state copy sit where they end), and the pages they put in the
    prefix index (whose KV never was). Returns those pages."""
    for step in steps:
        for chunk in step.prefill:
            chunk.request.prefilled = min(chunk.request.prefilled, chunk.start)
        for request in step.rows:
            if request.finish is not None:
                request.kv_len -= step.steps
    unwritten = {page for step in steps for page in step.indexed}
    scheduler.pages.unindex(list(unwritten))
    return unwritten


def _read_again(scheduler: Scheduler, request: Request, keep_pages: bool, unwritten: set[int]) -> None:
    """A request that produced nothing starts its prompt again: from its mount with its pages (the pool
    lives), or from the queue with none (the pool is gone; its conversation's KV with it). A prefix it
    took from the index that no step wrote (`unwritten`) it reads itself."""
    if request.phase is Phase.PREFILL:
        scheduler.prefilling.remove(request)
    else:
        scheduler.decoding.remove(request)
    request.kv_len, request.stale, request.last_seq = 0, True, -1
    if keep_pages:
        if request.state_slot and request.reused and not request.state_source:  # its state went on: read all
            request.reused = 0
        if unwritten.intersection(request.pages[: request.reused // scheduler.config.page_size]):
            request.reused = 0
        request.prefilled = request.reused
        request.phase = Phase.PREFILL
        scheduler.prefilling.append(request)
    else:
        request.pages, request.reused, request.prefilled, request.state_slot = [], 0, 0, 0
        request.state_source, request.marked_states = 0, {}
        request.phase = Phase.WAITING


def _forget_resident(scheduler: Scheduler, reason: str) -> int:
    """Conversations whose KV was in the lost pool forget it; parked ones (in the cache) are intact."""
    if scheduler.conversations is None:
        return 0
    lost = 0
    for conversation in list(scheduler.conversations._by_key.values()):
        if conversation.pages or conversation.states:
            conversation.states = {}  # the state pool is reset: nothing to give back
            conversation.forget()
            conversation.lost = reason
            lost += 1
    return lost
