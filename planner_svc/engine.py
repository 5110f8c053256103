"""The step loop of one executor group: plan, send two deep, commit outputs, hand tokens to requests."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from planner_svc.conversations import Conversation, Conversations
from planner_svc.link import ExecutorLink, LinkLost, StepRefused
from planner_svc.logprobs import logprob_rows
from planner_svc.prefill_progress import log_prefill_progress
from planner_svc.reconnect import RECONNECT_BACKOFF_S, reconnect
from planner_svc.recovery import Recovery, recover
from planner_svc.requests import Finish, Request
from planner_svc.scheduler import Scheduler
from planner_svc.step_wire import plan_summary, to_proto
from planner_svc.streaming import PendingTokens, StreamBudget, TokenEvent
from protos import executor_pb2
from protos.wire import unpack_i32

log = structlog.get_logger("deltaserve.planner.engine")

EXECUTOR_TIMEOUT_S = 5.0  # a step in flight with no output for this long (plus its prefill's allowance): hung
PREFILL_S_PER_TOKEN = 0.025  # the allowance per prompt token a step reads (2,048 tokens: 51 s, a slow CPU)


@dataclass(slots=True)
class StepTimes:
    """Host microseconds spent per phase, summed over steps (for the benchmarks)."""

    steps: int = 0
    plan_us: float = 0.0
    encode_us: float = 0.0
    send_us: float = 0.0
    wait_us: float = 0.0
    commit_us: float = 0.0
    stream_us: float = 0.0  # the client stream writes released before each wait (within wait_us)
    streams_written: int = 0
    plan_bytes: int = 0


class Engine:
    """Owns a scheduler and a link; one task runs the steps while requests come and go."""

    def __init__(
        self,
        scheduler: Scheduler,
        link: ExecutorLink,
        attached: executor_pb2.ExecutorDescription,
        inflight_plans: int = 2,
        executor_timeout: float = EXECUTOR_TIMEOUT_S,
    ):
        self.scheduler = scheduler
        self.link = link
        self.attached = attached  # what the executor (group) described when attached: checked on reconnect
        self.inflight_plans = inflight_plans
        self.times = StepTimes()
        self.steps = 0
        self.row_mismatches = 0
        self._queues: dict[Request, asyncio.Queue[TokenEvent]] = {}  # streams open, until their last event
        self._pending: PendingTokens[Request] = PendingTokens()
        self.stream_budget = StreamBudget()
        self._writes_ended: float | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._seq = 0
        self._inflight: deque[tuple[int, float]] = deque()  # (seq, how long its output may take)
        self.executor_timeout = executor_timeout
        self.failure: str | None = None  # why the executor is lost, while it is; new requests are refused
        self.on_health: Callable[[], None] | None = None  # called when `serving` changes
        self.losses = 0  # executor losses and refused plans recovered from
        self._recent: deque[executor_pb2.StepPlan] = deque(
            maxlen=4
        )  # the plans in flight, for a refusal's log
        # Called when the queue's head waits for pages (KV pressure): set by the Turns built over the engines
        self.on_blocked: Callable[[Engine], None] | None = None
        # (whether it ended, done once it has): a conversation's turn, or a request's steps
        self._end_waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []

    @property
    def serving(self) -> bool:
        return self.failure is None

    @property
    def load(self) -> int:
        return len(self._queues)

    @property
    def conversations(self) -> Conversations:
        """The scheduler's conversations (the planner builds every engine with them)."""
        conversations = self.scheduler.conversations
        if conversations is None:
            raise RuntimeError(f"the engine of executor {self.link.address} keeps no conversations")
        return conversations

    async def start(self) -> None:
        await self.link.open()
        self._task = asyncio.create_task(self._run(), name=f"engine {self.link.address}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.link.close()

    def submit(self, request: Request) -> asyncio.Queue[TokenEvent]:
        """Queue a request (checked by the scheduler first: ValueError / CapacityError change nothing)."""
        if self.failure is not None:
            raise ConnectionError(f"{self.failure}; reconnecting")
        self.scheduler.add(request)
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[request] = queue
        self._wake.set()
        return queue

    def turn_ended(self, conversation: Conversation) -> asyncio.Future[None]:
        """Done once the conversation runs no turn: its last turn's last step committed (or it had none)."""
        return self._when(lambda: not conversation.busy)

    def released(self, request: Request) -> asyncio.Future[None]:
        """Done once the request's last step committed and its pages went back (its conversation's turn ended
        with what it kept): a plan's steps after its last token at most, where they read its row."""
        return self._when(lambda: request.released)

    def _when(self, ended: Callable[[], bool]) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if ended():
            done.set_result(None)
        else:
            self._end_waiters.append((ended, done))
        return done

    def _turns_ended(self) -> None:
        """After a commit or an abort (what ends a turn): wake those waiting for it."""
        if not self._end_waiters:
            return
        waiting = []
        for ended, done in self._end_waiters:
            if done.done():  # its waiter gave up
                continue
            if ended():
                done.set_result(None)
            else:
                waiting.append((ended, done))
        self._end_waiters = waiting

    def wake(self) -> None:
        """Something outside the loop changed the schedule (pages returned): plan again."""
        self._wake.set()

    def abort(self, request: Request, finish: Finish = Finish.ABORT) -> bool:
        """End a running or waiting request (as aborted, or `finish`: STOP where its stream matched a stop
        string); its tokens not yet streamed are dropped. False (and nothing changes) when it had finished:
        its last tokens still go to its stream."""
        aborted = self.scheduler.abort(request, finish)
        if aborted:
            self._pending.drop(request)
            queue = self._queues.pop(request, None)
            if queue is not None:
                queue.put_nowait(TokenEvent([], finish))
        self._turns_ended()
        self._wake.set()
        return aborted

    def refuse(self, request: Request, code: str, message: str) -> None:
        """End a waiting request that cannot be admitted as things stand with status `code` (a grpc.StatusCode
        name); its conversation keeps what its mount held."""
        if self.scheduler.abort(request):
            request.refused = code
            self._end(request, code, message)
        self._turns_ended()
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self._steps()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a plan refused, the stream broke or the executor hung
                await self._recover_from(error)

    async def _recover_from(self, error: Exception) -> None:
        """Fail, free, reconnect. A recovery that raises (a planner defect) is logged with its traceback, the
        requests it had ended without a word end with INTERNAL, and the executor is handled as lost, until a
        recovery ends (one attempt per reconnect backoff, not a spin): the loop never ends for everyone."""
        while True:
            try:
                if isinstance(error, StepRefused):
                    await self._refused(str(error))
                else:
                    await self._lost(error)
                return
            except asyncio.CancelledError:
                raise
            except Exception as defect:
                log.exception("recovery failed (a planner defect); the executor is handled as lost")
                words = f"{type(defect).__name__}: {defect}"
                self._stream(len(self._pending))  # what was produced first; then the finished still open
                for request in [r for r in self._queues if r.finish is not None]:
                    self._end(request, "INTERNAL", f"the planner failed to recover this request: {words}")
                self._turns_ended()
                error = LinkLost(f"recovery failed: {words}")
                await asyncio.sleep(RECONNECT_BACKOFF_S[0])

    async def _steps(self) -> None:
        while True:
            if len(self._inflight) >= self.inflight_plans:
                await self._receive()
                continue
            began = time.perf_counter()
            step = self.scheduler.plan(self._seq)
            planned = time.perf_counter()
            if self.on_blocked is not None and self.scheduler.blocked():
                self.on_blocked(self)
            if step is None:
                if self._inflight:
                    await self._receive()
                else:
                    self._stream(len(self._pending))  # no step to feed: every stream gets its tokens
                    self._wake.clear()
                    await self._idle()
                continue
            plan = to_proto(step)
            self._seq += 1  # the step exists from now on, sent or not: a recovery counts it
            encoded = time.perf_counter()
            allowance = self.executor_timeout * step.steps
            if step.prefill:
                allowance += PREFILL_S_PER_TOKEN * sum(len(c.token_ids) // 4 for c in step.prefill)
                log_prefill_progress(step.prefill)
            self._recent.append(plan)
            await self.link.send(plan)
            sent = time.perf_counter()
            times = self.times
            times.plan_us += (planned - began) * 1e6
            times.encode_us += (encoded - planned) * 1e6
            times.send_us += (sent - encoded) * 1e6
            times.plan_bytes += plan.ByteSize()
            self._inflight.append((plan.seq, allowance))

    async def _idle(self) -> None:
        """Until there is something to plan; an executor lost meanwhile is noticed at once (its stream's
        end), not when the next step is sent. Two tasks an idle spell, nothing on the path of a step."""
        woken = asyncio.ensure_future(self._wake.wait())
        ended = asyncio.ensure_future(self.link.until_ended())
        try:
            await asyncio.wait((woken, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            ended.cancel()
        if ended.done() and not ended.cancelled():
            raise LinkLost(f"{ended.result()} (while idle)")

    def _stream(self, count: int) -> int:
        """Hand the `count` oldest pending events to their streams; their writes run when the loop next waits."""
        taken = self._pending.take(count)
        for request, event in taken:
            queue = self._queues[request]
            queue.put_nowait(event)
            if event.finish is not None:
                del self._queues[request]
        return len(taken)

    def _writes_end(self) -> None:
        self._writes_ended = time.perf_counter()

    async def _receive(self) -> None:
        began = time.perf_counter()
        written = self._stream(self.stream_budget.allowance())
        # Scheduled behind the released streams' wake-ups, so it runs when their writes have been issued.
        self._writes_ended = None
        asyncio.get_running_loop().call_soon(self._writes_end)
        seq, allowance = self._inflight[0]
        try:
            async with asyncio.timeout(allowance):  # the watchdog: one timer handle a step
                output = await self.link.recv()
        except TimeoutError:
            raise LinkLost(f"hung: no output of step {seq} for {allowance:.1f} s") from None
        received = time.perf_counter()
        writes_us = ((self._writes_ended or received) - began) * 1e6 if written else 0.0
        self.stream_budget.observe(written, writes_us, (received - began) * 1e6, output.device_wait_us)
        self._inflight.popleft()
        if output.seq != seq:
            raise RuntimeError(f"executor answered step {output.seq}, expected {seq}")
        logprobs = logprob_rows(output.logprobs, output.logprob_ids)
        produced = self.scheduler.commit(
            seq, unpack_i32(output.tokens), unpack_i32(output.prefill_tokens), logprobs
        )
        self.row_mismatches += output.row_mismatches
        if output.row_mismatches:
            log.error("row check failed", seq=seq, mismatches=output.row_mismatches)
        pending, queues = self._pending, self._queues
        for request, token, entry in produced:
            if request in queues:  # not aborted meanwhile
                pending.add(request, token, request.finish, entry)
        self._turns_ended()
        self.steps += 1
        times = self.times
        times.steps += 1
        times.wait_us += (received - began) * 1e6
        times.stream_us += writes_us
        times.streams_written += written
        times.commit_us += (time.perf_counter() - received) * 1e6

    # ---- an executor lost, or a plan refused (DESIGN §7 invariant 7) ----

    async def _refused(self, error: str) -> None:
        """A planner defect: the refused step's requests end with INTERNAL, the others go on over a new
        stream with their rows written whole."""
        seq = self._inflight[0][0] if self._inflight else -1
        plan = next((p for p in self._recent if p.seq == seq), None)
        log.error(
            "executor refused a plan (a planner defect); its requests fail, the rest go on",
            executor=self.link.address,
            error=error,
            plan=plan_summary(plan) if plan is not None else None,
        )
        result = self._recover(seq)
        for request in result.refused:
            self._end(request, "INTERNAL", f"the executor refused the step planned for this request: {error}")
        self._end_failed(result, "a refused plan")
        log.info("step stream reopened", executor=self.link.address, requeued=len(result.requeued))
        self.losses += 1
        await self.link.open()

    async def _lost(self, error: Exception) -> None:
        reason = str(error) if isinstance(error, LinkLost) else f"{type(error).__name__}: {error}"
        address = self.link.address
        self.failure = f"executor {address} was lost ({reason})"
        self._health()
        result = self._recover(None, f"its KV was lost with executor {address}")
        for request in result.cut:
            self._end(
                request,
                "UNAVAILABLE",
                f"{self.failure}; the request was cut after {len(request.output_ids)} tokens",
            )
        self._end_failed(result, "the executor's loss")
        log.error(
            "executor lost",
            executor=address,
            reason=reason,
            cut=len(result.cut),
            requeued=len(result.requeued),
            conversations_lost=result.conversations_lost,
        )
        self.losses += 1
        await reconnect(self.link, self.attached)
        self.failure = None
        self._health()
        self._wake.set()

    def _recover(self, refused_seq: int | None, reason: str = "") -> Recovery:
        self._stream(len(self._pending))  # tokens already produced reach their streams first
        self._inflight.clear()
        self._recent.clear()
        result = recover(self.scheduler, self._seq - 1, refused_seq, reason)
        self._turns_ended()
        return result

    def _end_failed(self, result: Recovery, after: str) -> None:
        """The requests whose host truth the recovery could not rebuild: a planner defect, logged; they end."""
        for request, defect in result.failed:
            log.error(
                "a request's recovery failed (a planner defect)", request=request.request_id, exc_info=defect
            )
            words = f"{type(defect).__name__}: {defect}"
            self._end(
                request, "INTERNAL", f"the planner could not recover this request after {after}: {words}"
            )

    def _end(self, request: Request, code: str, message: str) -> None:
        self._pending.drop(request)
        queue = self._queues.pop(request, None)
        if queue is not None:
            queue.put_nowait(TokenEvent([], Finish.ABORT, error=message, code=code))

    def _health(self) -> None:
        if self.on_health is not None:
            self.on_health()
