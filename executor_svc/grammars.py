"""Structured output on the executor: one xgrammar matcher per constrained slot, advanced by the tokens its
steps sample as they reach the host, and the bitmask of what it allows next filled into the sampler's
per-slot grammar mask before each step that reads it.

A step that reads a constrained slot needs that slot's previous token accepted first, so it waits for the
steps launched before it (the only steps that lose the two-deep pipelining); steps without constrained rows
never wait. xgrammar's view of the vocabulary takes seconds to build (the import, the tokenizer): a service's
executor builds it on a thread of its own at start (`warm`), so no step waits for it (a process exiting
meanwhile waits for that thread first, WARM_EXIT_WAIT_S at most); otherwise the first grammar does.

A grammar is compiled once and kept in a bounded LRU map (`cache_size` compiled grammars; one takes from tens
of KB to a few MB), on the grammar thread (`compile_ahead`), the event loop free meanwhile: the planner asks
for it (PrepareGrammar) before it submits the request, so no step waits for it; should a plan bring one not
compiled (evicted meanwhile, or a planner that did not ask), it is compiled before that plan launches, the
steps already launched collected and answered meanwhile.
A schema that does not compile is a PlanError (INVALID_ARGUMENT), raised before anything changes.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch

from executor_svc.bounded_lru import BoundedLru
from executor_svc.config import DEFAULT_GRAMMAR_CACHE
from executor_svc.control_writes import ControlWrites, grammar_text
from executor_svc.plan import CheckedPlan, PlanError
from executor_svc.sampler_controls import SamplerControls
from executor_svc.slot_store import SlotStore
from protos import executor_pb2
from protos.grammar_compile import compile_json
from protos.grammar_errors import compile_error
from protos.model_files import TRANSFORMERS_IMPORTS, load_tokenizer

if TYPE_CHECKING:
    from executor_svc.launched_step import LaunchedStep


log = structlog.get_logger("deltaserve.executor.grammars")

WARM_EXIT_WAIT_S = 30.0  # how long an exiting process waits for a warm build still under way
# The warm builds' threads, still running or not yet joined. Python 3.11 ends a daemon thread that outlives
# finalization with pthread_exit, whose forced unwind through C++ aborts the process ("terminate called without an
# active exception"): through xgrammar's import, or through torch freeing the Grammars' tensors where the thread
# held the last reference (its target, a bound method, is dropped as the thread ends: after the build). An exit
# joins them first, so each stays in the set until its thread has ended. They stay daemon threads so a build that
# hangs holds an exit only WARM_EXIT_WAIT_S.
_warming: set[threading.Thread] = set()


@atexit.register  # atexit runs before finalization, while a daemon thread still runs as usual
def join_warm_builds(timeout: float = WARM_EXIT_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    for thread in list(_warming):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning("exiting with xgrammar's warm build still under way", waited_s=timeout)


class Grammars:
    def __init__(
        self,
        controls: SamplerControls,
        model: str | None,
        *,
        warm: bool = False,
        cache_size: int = DEFAULT_GRAMMAR_CACHE,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._controls = controls
        self._model = model
        # The model's end-of-sequence ids, what a complete grammar allows (the planner stops at them); empty:
        # the tokenizer's, as xgrammar finds them.
        self._eos_token_ids = list(eos_token_ids)
        # xgrammar's objects (imported with the compiler: the import takes seconds)
        self._compiler: Future[Any] | None = None
        if warm:
            self._compiler = Future()
            thread = threading.Thread(target=self._build_compiler, name="grammar-compiler", daemon=True)
            _warming.difference_update([t for t in _warming if not t.is_alive()])
            _warming.add(thread)
            thread.start()
        self._compiled: BoundedLru[str, Any] = BoundedLru(cache_size)  # grammar text -> CompiledGrammar
        self._compiling = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.late_compiles = 0  # steps that waited for a grammar's compile (PrepareGrammar had not done it)
        self._matchers: dict[int, Any] = {}  # slot -> GrammarMatcher
        self._last = np.zeros(len(controls.on), dtype=np.int64)  # by slot: the last token read back
        self._unfed: list[tuple[LaunchedStep, np.ndarray]] = []  # launched steps and the slots they sampled
        # On the CPU, feed runs on the event loop (a step collected) and on the compute thread (a constrained
        # step launching behind it) at once: one at a time, or a step could be fed twice or out of order.
        self._feeding = threading.Lock()

    def before(self, plan: CheckedPlan, store: SlotStore) -> bool:
        """Before a plan is applied: whether its step involves a grammar (it writes one or samples a
        constrained slot); if so, every step launched before it is waited for and fed to the matchers."""
        grammars = [g for g in plan.controls.grammars if g is not None] if plan.controls is not None else []
        for grammar in grammars:  # compiled ahead by the server, so found here; one that fails is refused now
            self._compile(grammar)
        involved = bool(grammars)
        if not involved and self._matchers:
            involved = any(slot in self._matchers for slot in step_slots(plan, store, plan.slots).tolist())
        if involved:
            self.feed(None)
        return involved

    def after(self, plan: CheckedPlan, store: SlotStore) -> None:
        """After an involved plan is applied: the matchers of its writes, and the masks its step reads."""
        if len(plan.sampler_slots):
            prefill = [slot for slot in plan.sample_slots if slot]
            self.write(plan.sampler_slots, plan.sampler_i32[:, 3], prefill, plan.controls)
        self.fill(step_slots(plan, store, None))

    def feed(self, through: LaunchedStep | None) -> None:
        """Let the matchers accept the tokens of the launched steps, in launch order, up to `through` (None:
        all of them, waiting for those still running)."""
        with self._feeding:
            while self._unfed and (through is None or self._unfed[0][0].seq <= through.seq):
                step, slots = self._unfed[0]
                step.wait()
                self._unfed.pop(0)
                # A plan of several steps reads back steps x rows: the last step's are the rows' last.
                tokens = step.host_tokens.numpy()
                self._accept(slots, tokens[len(tokens) - len(slots) :])

    def _accept(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        self._last[slots] = tokens
        for slot, token in zip(slots.tolist(), tokens.tolist()):
            matcher = self._matchers.get(slot)
            if matcher is None:
                continue
            if not matcher.accept_token(token):
                self._end_row(slot, token)
            elif matcher.is_terminated():  # its end-of-sequence: the request stops, the slot is free of it
                del self._matchers[slot]
                self._controls.grammar_mask[slot] = -1

    def _end_row(self, slot: int, token: int) -> None:
        """A token the slot's grammar refused was sampled (a defect: its mask forbade it). The row's matcher
        is dropped and its mask allows only end-of-sequence, so that request ends at its next token and no
        other row nor the executor is touched."""
        stops = self._matchers.pop(slot).stop_token_ids
        log.error("a sampled token broke the row's grammar; the row ends", slot=slot, token=token)
        words = np.zeros(self._controls.grammar_mask.shape[1], dtype=np.uint32)  # xgrammar's layout
        for stop in stops:
            words[stop // 32] |= np.uint32(1 << (stop % 32))
        self._controls.grammar_mask[slot] = torch.from_numpy(words.view(np.int32)).to(self._controls.device)

    def write(
        self,
        sampler_slots: np.ndarray,
        last_tokens: np.ndarray,
        prefill_slots: list[int],
        writes: ControlWrites | None,
    ) -> None:
        """Slots written whole: their matchers dropped, or rebuilt from the output so far where the write has
        a grammar. `last_tokens`: the write's last_token per sampler slot (< 0: the device's loop-back, read
        back already, unless the slot samples this step's prefill and has no output yet)."""
        for slot in sampler_slots.tolist():
            self._matchers.pop(slot, None)
        if writes is None:
            return
        at = 0
        for row, slot in enumerate(writes.slots.tolist()):
            n_bias, n_prompt, n_output, n_stop = writes.i32[row, 3:].tolist()
            output = writes.tokens[at + n_bias + n_prompt : at + n_bias + n_prompt + n_output].tolist()
            at += n_bias + n_prompt + n_output + n_stop
            grammar = writes.grammars[row]
            if grammar is None:
                continue
            matcher = self._matcher(grammar)
            last = int(last_tokens[list(sampler_slots).index(slot)])
            pending = [last] if last >= 0 else [] if slot in prefill_slots else [int(self._last[slot])]
            for token in output + pending:
                matcher.accept_token(token)
            self._matchers[slot] = matcher

    def fill(self, slots: np.ndarray) -> None:
        """The grammar masks of the constrained ones of `slots`, for the step about to read them."""
        import xgrammar

        constrained = [slot for slot in dict.fromkeys(slots.tolist()) if slot in self._matchers]
        if not constrained:
            return
        masks = xgrammar.allocate_token_bitmask(len(constrained), self._controls.vocab_size)
        for row, slot in enumerate(constrained):
            self._matchers[slot].fill_next_token_bitmask(masks, row)
        index = torch.tensor(constrained, device=self._controls.device)
        self._controls.grammar_mask[index] = masks.to(self._controls.device)

    def launched(self, step: LaunchedStep, store: SlotStore) -> None:
        """A step was launched: its tokens go to the matchers once read back (`feed`)."""
        if self._matchers or self._unfed:
            self._unfed.append((step, step_slots(step.plan, store, None)))

    async def compile_ahead(self, grammars: list[str]) -> int:
        """Compile those of `grammars` not compiled yet on the grammar thread, the event loop free meanwhile,
        and say how many; PlanError for one that cannot be compiled (nothing changed)."""
        missing = [text for text in grammars if text not in self._compiled]
        if missing:
            await asyncio.get_running_loop().run_in_executor(self._compiling, self._compile_all, missing)
        return len(missing)

    async def before_launch(self, plan: executor_pb2.StepPlan) -> None:
        """The plan's grammars compiled before it launches. Those PrepareGrammar did not compile (evicted
        since, or never asked for) are compiled now: that step waits, counted in `late_compiles`."""
        if await self.compile_ahead(plan_grammars(plan)):
            self.late_compiles += 1
            log.info("a step waited for its grammar's compile", seq=plan.seq)

    def _compile_all(self, grammars: list[str]) -> None:
        for grammar in dict.fromkeys(grammars):
            self._compile(grammar)

    def forget_launched(self) -> None:
        """The launched steps will never be collected (their stream ended): the planner rewrites every row,
        and with it every matcher, so their tokens must not reach the new ones."""
        self._unfed.clear()

    def _compiler_now(self) -> Any:
        """The compiler, built here if no thread started building it, or built again where the build failed
        to import (transformers imported by another thread outside TRANSFORMERS_IMPORTS, at the same time:
        once that is done, it works)."""
        if self._compiler is not None:
            try:
                return self._compiler.result()
            except ImportError:
                pass
        self._compiler = Future()
        self._build_compiler()
        return self._compiler.result()

    def _build_compiler(self) -> None:
        assert self._compiler is not None
        try:
            with TRANSFORMERS_IMPORTS:
                import xgrammar
            info = xgrammar.TokenizerInfo.from_huggingface(
                load_tokenizer(self._model),
                vocab_size=self._controls.vocab_size,
                stop_token_ids=self._eos_token_ids or None,
            )
            # xgrammar's own cache is unbounded: the LRU map above keeps the compiled grammars instead
            self._compiler.set_result(xgrammar.GrammarCompiler(info, cache_enabled=False))
        except Exception as error:  # raised where a grammar first needs it
            self._compiler.set_exception(error)

    def _compile(self, grammar: str) -> Any:
        """The grammar compiled (from the LRU map, or now); PlanError where xgrammar refuses it."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiler = self._compiler_now()
            try:
                compiled = compile_json(compiler, grammar)  # as the planner compiled it at intake
            except (RuntimeError, ValueError) as error:
                why = compile_error(error)  # xgrammar's reason, less its time and C++ source position
                raise PlanError(f"control_grammar: the JSON schema cannot be compiled: {why}") from None
            self._compiled.put(grammar, compiled)
        return compiled

    def _matcher(self, grammar: str):
        import xgrammar

        return xgrammar.GrammarMatcher(self._compile(grammar))


def plan_grammars(plan: executor_pb2.StepPlan) -> list[str]:
    """The grammars a plan writes, as Grammars keeps them."""
    return [text for text in map(grammar_text, plan.control_grammar) if text is not None]


def step_slots(plan: CheckedPlan, store: SlotStore, decode: np.ndarray | None) -> np.ndarray:
    """The slots a step samples, in its tokens' order: its prefill chunks that sample, then its decode rows
    (`decode`, or the rows the store holds for its bucket)."""
    prefill = np.asarray([slot for slot in plan.sample_slots if slot], dtype=np.int64)
    if decode is None:
        decode = store.host_slots(plan.bucket)
    return np.concatenate([prefill, np.asarray(decode, dtype=np.int64)])
