"""Admission against the page budget, chunked prefill, decode row choice and the plan of each step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

import numpy as np

from planner_svc.admission import Admission
from planner_svc.conversations import Conversations
from planner_svc.decode_rows import in_slot_order, ready_rows, repeats_left, steps_per_repeat, stored_lengths
from planner_svc.loans import Loans
from planner_svc.logprobs import LogprobRow
from planner_svc.pages import PagePool
from planner_svc.planned import PlannedStep, PrefillChunk, SchedulerConfig, check_request
from planner_svc.requests import Finish, Phase, Request
from planner_svc.rows import RowMirror
from planner_svc.sampler_state import SamplerWrites
from planner_svc.slots import SlotCache
from planner_svc.state_marks import MarkCopies
from planner_svc.state_pressure import StatePressure
from planner_svc.state_slots import StateSlots
from planner_svc.tenant_order import TenantOrder
from protos.layout import RowLayout
from protos.wire import I32


class Scheduler:
    """The host truth of one executor group: requests, pages, slots and the row mirror."""

    def __init__(
        self, config: SchedulerConfig, layout: RowLayout, conversations: Conversations | None = None
    ):
        self.config = config
        self.conversations = conversations
        self.layout = layout
        self.pages = PagePool(config.pool_pages)
        self.slots: SlotCache[Request] = SlotCache(layout.widest_bucket)
        self.states = StateSlots(config.state_slots)
        if conversations is not None:  # their checkpoints' state copies take slots of the same pool
            conversations.states = self.states
        self.marks = MarkCopies(self.states)
        self.loans = Loans()  # pages and state slots an executor RPC writes into (a restore)
        # Shared prefix pages would skip tokens whose recurrent state no page holds: off for such models.
        self.prefix_cache = config.settings.prefix_cache and not self.states.enabled
        self.mirror = RowMirror(layout)
        self.waiting: deque[Request] = deque()  # ordered by tenant_order: tenants take turns
        self.order = TenantOrder()
        self.admission: Admission[Request] = Admission(config.settings.admission_skips)
        self.pressure = StatePressure(self.states, conversations, self.loans, self.admission.scan_limit)
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.committed = -1
        self._pending_free: list[Request] = []  # done, waiting for the commit of their last step
        self._steps: dict[int, PlannedStep] = {}  # uncommitted plans
        self._steady: PlannedStep | None = None  # the last decode step, repeatable while nothing changes
        self._steady_left = 0  # steps it can repeat before a row reaches its end
        self._steady_steps = 1  # decode steps a plan of its repeats runs
        # At most this many, and one with row checks or recurrent state (a turn's checkpoint keeps nothing once
        # its state has read a token past the stop).
        settings = config.settings
        self._plan_steps = 1 if settings.row_check or self.states.enabled else settings.steps_per_plan
        self._steady_slots = np.zeros(0, dtype=I32)  # its slots, padding included
        self._steady_ends = np.zeros(0, dtype=np.int64)  # its real rows' end lengths
        self._dirty = True
        self._assigned_seq = -1  # the last step whose reads the slot cache knows

    # --- requests in and out -------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Refuse what could never run, and clamp max_tokens to the context (planned.check_request)."""
        check_request(request, self.config, self.pages.total, self.states)

    def add(self, request: Request) -> None:
        self.check(request)
        self.order.place(self.waiting, request)
        self._dirty = True

    def abort(self, request: Request, finish: Finish = Finish.ABORT) -> bool:
        """Finish it (aborted, or stopped by a stop string); False if it had already finished."""
        if request.finish is not None:
            return False
        if request.phase is Phase.WAITING:
            self.waiting.remove(request)
            self.admission.forget(request)
            self.order.forget(self.waiting, request)
            request.phase = Phase.DONE
            self._release_pages(request)
        else:
            self._retire(request)
        request.finish = finish
        self._dirty = True
        return True

    def mark_stale(self, requests: list[Request] | None = None) -> None:
        """Their device rows are no longer trusted (a host-planned step, an executor restart): the next
        decode that reads them writes them whole. None marks every decoding request."""
        self._sync_reads()
        for request in self.decoding if requests is None else requests:
            if request.phase is Phase.DECODE and not request.stale:
                request.kv_len = self._kv_len(request)
                request.stale = True
        self._dirty = True

    @property
    def idle(self) -> bool:
        """Nothing queued, running, or waiting for the commit of its last step."""
        return not (self.waiting or self.prefilling or self.decoding or self._pending_free or self._steps)

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def stalled(self) -> bool:  # nothing runs nor awaits its last commit: no page comes back on its own
        return not (self.prefilling or self.decoding or self._pending_free)

    # --- planning ------------------------------------------------------------------------------

    def plan(self, seq: int) -> PlannedStep | None:
        """Step `seq`, or None when nothing can run until an output arrives (after step `seq - 2` commits)."""
        if not self._dirty and self._steady is not None and self._steady_left > 0:
            return self._repeat(seq)
        self._sync_reads()
        self._dirty = False
        self._admit()
        self.marks.step_begins(self.committed)
        candidates = list(self.decoding)  # the rows that may decode: not those whose prompt ends this step
        lens = stored_lengths(candidates, self.slots.slots_of(candidates), self.mirror.rows)
        step = PlannedStep(seq)
        finals = [] if self._prompts_wait(candidates, lens) else self._plan_prefill(step)
        room = self.layout.widest_bucket - len(finals)
        # More rows than the widest bucket: the least recently run go first, and the rows rotate (dirty).
        ready, ends, rotate = ready_rows(candidates, lens, room)
        self._dirty = self._dirty or rotate
        if not (step.prefill or ready):
            self._steady, self._steady_left = None, 0
            return None
        self.marks.copy_into(step, len(self.waiting))
        writes = SamplerWrites()
        if finals or ready:
            self._assign(seq, finals + ready)
        for chunk in step.prefill:
            if chunk.sample_slot < 0:  # the chunk that ends the prompt samples into its slot
                chunk.sample_slot = self.slots.held_slot(chunk.request)
                writes.add(chunk.sample_slot, chunk.request, last_token=-1)
            chunk.request.last_seq = seq
        self._plan_decode(step, ready, ends, writes)
        step.sampler = writes if writes else None
        self._steps[seq] = step
        self._steady = step if step.bucket and not step.prefill else None
        self._assigned_seq = seq
        self._steady_left = 0
        if self._steady is not None:  # its repeats read its slots while none reads a row past its end
            self._steady_slots = self.mirror.last_slots
            self._steady_left = repeats_left(self._steady_ends, self.mirror.rows, self._steady_slots)
            self._steady_steps = steps_per_repeat(step.rows, self._plan_steps)
        if self.prefilling or (self.waiting and self._can_admit(self.waiting[0])):
            self._dirty = True
        return step

    def _repeat(self, seq: int) -> PlannedStep:
        """A steady step: the same rows, nothing new; only the seq and bucket travel (_admit: every page)."""
        steps = min(self._steady_steps, self._steady_left)
        self._steady_left -= steps
        last = self._steady
        assert last is not None  # a repeat follows a steady step
        step = PlannedStep(seq, bucket=last.bucket, rows=last.rows, steps=steps)
        if self.config.settings.row_check:
            step.mirror = self.mirror.read(self._steady_slots).tobytes()
        self.mirror.advance(steps)
        for request in last.rows:
            request.last_seq = seq
        self._steps[seq] = step
        self._steady = step
        return step

    def _sync_reads(self) -> None:
        """Tell the slot cache about the reads of repeated steps, before it decides anything."""
        steady = self._steady
        if steady is not None and steady.seq > self._assigned_seq:
            rows = steady.rows
            self.slots.assign(
                steady.seq, [r for r, s in zip(rows, self.slots.slots_of(rows)) if s is not None]
            )
            self._assigned_seq = steady.seq

    def _assign(self, seq: int, requests: list[Request]) -> None:
        slot_of = self.slots.slot_of
        missing = self.slots.slots_of(requests).count(None)
        # Displacement hands a victim's slot to another row this step: keep the victim's length first.
        holders = (
            {r: slot for r in self.decoding if (slot := slot_of(r)) is not None}
            if missing > self.slots.free_count
            else {}
        )
        assignment = self.slots.assign(seq, requests)
        for victim in assignment.displaced:
            if not victim.stale:
                victim.kv_len = self.mirror.kv_len(holders[victim])
            victim.stale = True
        for request in assignment.fresh:
            request.stale = True

    def _prompts_wait(self, candidates: list[Request], lens: np.ndarray) -> bool:
        """Whether this step's prompts wait for the next: while a step reading prompts is in flight, a row (of
        `candidates`, stored `lens` long) can decode meanwhile, and they would not fill a step. Each prefill
        step reads every weight again: a burst's prompts share the next step rather than trickle into their
        own; with no row to decode they go at once, rather than leave the GPU idle."""
        if not any(step.prefill for step in self._steps.values()):
            return False
        at_hand = sum(request.prompt_len - request.prefilled for request in self.prefilling)
        can_decode = any(n < r.end_len for r, n in zip(candidates, lens.tolist(), strict=True))
        return can_decode and at_hand < self.config.settings.token_budget

    def _plan_prefill(self, step: PlannedStep) -> list[Request]:
        """Chunks of admitted prompts up to the token budget; returns the requests whose prompt ends."""
        budget, finals = self.config.settings.token_budget, list[Request]()
        page_size = self.config.page_size
        for request in list(self.prefilling):
            if budget == 0 or len(finals) == self.layout.widest_bucket:
                break
            start = request.prefilled
            end = self.marks.chunk_end(request, start, start + min(request.prompt_len - start, budget))
            self.marks.chunk_planned(request, end)
            budget -= end - start
            chunk = PrefillChunk(
                request,
                start,
                np.asarray(request.prompt_ids[start:end], dtype=I32).tobytes(),
                np.asarray(request.pages[: -(-end // page_size)], dtype=I32).tobytes(),
                sample_slot=0,
                state_slot=request.state_slot,
            )
            if start == request.reused and request.state_source:  # a resumed turn: its checkpoint's state
                step.state_copies.append((request.state_source, request.state_slot))
            request.prefilled = end
            if self.prefix_cache:
                full = end // page_size
                hashes = request.prefix_hashes(full * page_size, page_size)
                step.indexed += self.pages.register(hashes, request.pages[:full])
            if end == request.prompt_len:
                chunk.sample_slot = -1  # set from this step's slot assignment
                finals.append(request)
                self.prefilling.remove(request)
                request.phase = Phase.DECODE
                request.kv_len = request.prompt_len
                request.stale = True
                self.decoding.append(request)
            step.prefill.append(chunk)
        return finals

    def _plan_decode(
        self, step: PlannedStep, ready: list[Request], ends: np.ndarray, writes: SamplerWrites
    ) -> None:
        if not ready:
            return
        ready, held, self._steady_ends = in_slot_order(ready, self.slots.slots_of(ready), ends)
        bucket = next(b for b in self.config.buckets if b >= len(ready))
        slots = np.zeros(bucket, dtype=I32)
        slots[: len(ready)] = held
        whole: list[tuple[int, np.ndarray]] = []
        for request, slot in zip(ready, slots.tolist()):
            if request.stale:  # its kv_len is the request's own (_kv_len)
                whole.append(
                    (
                        slot,
                        self.mirror.whole_row(request.kv_len, request.pages, state_slot=request.state_slot),
                    )
                )
                last = request.output_ids[-1] if request.last_seq <= self.committed else -1
                writes.add(slot, request, last_token=last)
                request.stale = False
            request.last_seq = step.seq
        step.bucket = bucket
        step.rows = ready
        step.delta = self.mirror.encode(slots, whole)
        if self.config.settings.row_check:
            step.mirror = self.mirror.read(slots).tobytes()
        self.mirror.advance()

    def _kv_len(self, request: Request) -> int:
        return int(stored_lengths([request], [self.slots.slot_of(request)], self.mirror.rows)[0])

    # --- admission (the order: admission.py) ----------------------------------------------------
    def _can_admit(self, request: Request) -> bool:
        need = request.pages_needed(self.config.page_size) - len(request.pages)
        if self.prefix_cache and not request.pages:  # prefix pages other requests hold take no free page
            need -= self.pages.held_prefix(request.reusable_hashes(self.config.page_size))
        return self.pages.free_count >= need and not self.pressure.starved(request)

    def take_pages(self, n: int) -> list[int] | None:
        """Pages for something outside the schedule (a restore)."""
        if self.pages.free_count < n:
            return None
        self._dirty = True
        return self.pages.allocate(n)

    def return_pages(self, pages: list[int]) -> None:
        """Pages no step reads any more (a conversation's released or parked pages)."""
        if pages:
            self.pages.free(pages)
            self._dirty = True

    def blocked(self) -> bool:
        """The head of the queue waits for pages."""
        return bool(self.waiting) and not self._can_admit(self.waiting[0])

    def _admit(self) -> None:
        """In the queue's order (tenants take turns, each first come, first served); a bounded number may pass a
        head waiting for pages (admission.py)."""
        page_size = self.config.page_size
        freed, frees_head = self.pressure.before_admission(self.waiting[0] if self.waiting else None)
        self.pages.free(freed)  # state pressure: a checkpoint's copy went back (state_pressure.py)
        for request in self.admission.take(self.waiting, self._can_admit, frees_head):
            self.order.admitted(request)
            request.admitted_at = request.admitted_at or time.perf_counter()  # a requeued one: its first
            if self.prefix_cache and not request.pages:
                self._match_prefix(request)
            if self.states.enabled and not request.state_slot:
                self.pressure.take_slot(request)
            # Every page it can write, now: its decode steps then never cross onto a page the device
            # row lacks, so a steady step's plan stays the seq and the bucket at any batch size.
            request.pages += self.pages.allocate(request.pages_needed(page_size) - len(request.pages))
            request.prefilled = request.reused
            request.phase = Phase.PREFILL
            self.prefilling.append(request)
        self.order.settle(self.waiting)

    def _match_prefix(self, request: Request) -> None:
        """Take the indexed full pages of the prompt's start, leaving at least one token to read."""
        request.pages = self.pages.match_prefix(request.reusable_hashes(self.config.page_size))
        request.reused = len(request.pages) * self.config.page_size

    # --- outputs -------------------------------------------------------------------------------

    def commit(
        self, seq: int, tokens: np.ndarray, prefill: np.ndarray, logprobs: Iterator[LogprobRow] | None = None
    ) -> list[tuple[Request, int, LogprobRow | None]]:
        """Step `seq`'s tokens (and logprobs of the rows that asked) arrived: (request, token, logprobs) for every
        token a client gets; `finish` set on a request's last. Tokens of rows already finished are dropped."""
        self._sync_reads()
        step = self._steps.pop(seq)
        produced: list[tuple[Request, int, LogprobRow | None]] = []
        sampled = [(chunk.request, int(t)) for chunk, t in zip(step.prefill, prefill) if t >= 0]
        for step_tokens in tokens.reshape(step.steps, -1).tolist():  # step after step
            sampled += zip(step.rows, step_tokens)
        for request, token in sampled:
            entry = next(logprobs) if logprobs is not None and request.sampling.top_logprobs >= 0 else None
            if request.finish is not None:
                continue  # ran once more after its stop; the token is dropped
            produced.append((request, token, entry))
            if request.take(token) is not None:
                self._retire(request)
                self._dirty = True
        self.committed = seq
        self.slots.commit(seq)
        self._free_committed()
        return produced

    def _retire(self, request: Request) -> None:
        """Leaves the schedule now; its slot cools and its pages return once its last step commits."""
        self._sync_reads()
        if request.phase is Phase.PREFILL:
            self.prefilling.remove(request)
        elif request.phase is Phase.DECODE:
            self.decoding.remove(request)
            request.kv_len = self._kv_len(request)  # where its state ends: a run after its stop included
        request.phase = Phase.DONE
        self.slots.release(request)
        self._pending_free.append(request)
        self._free_committed()

    def _free_committed(self) -> None:
        still = []
        for request in self._pending_free:
            if request.last_seq <= self.committed:
                self._release_pages(request)
                self._dirty = self._dirty or bool(self.waiting)  # a waiting request may fit now
            else:
                still.append(request)
        self._pending_free = still

    def _release_pages(self, request: Request) -> None:
        """Its steps are done: a conversation keeps the pages of its tokens, the rest return to the pool."""
        pages, request.pages = request.pages, []
        state_slot, request.state_slot = request.state_slot, 0
        if request.conversation is not None and self.conversations is not None:
            pages = self.conversations.end_turn(request, pages, state_slot)
        elif state_slot:
            self.states.give_back(state_slot)
        self.pages.free(pages)
        request.released = True
