"""The executor's grammars (executor_svc/grammars.py) with xgrammar and SmolLM2's tokenizer: compiled off the
event loop into a bounded LRU map, a schema that cannot compile refused as a PlanError naming why in words, and
a sampled token the grammar refuses ending only its own row."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from executor_svc.grammars import Grammars, plan_grammars
from executor_svc.launched_step import LaunchedStep
from executor_svc.plan import PlanError
from executor_svc.sampler_controls import SamplerControls
from protos import executor_pb2
from protos.grammar_compile import MAX_JSON_WHITESPACE
from tests.cli_helpers import REPO, cli_env
from tests.loop_turns import loop_turns

VOCAB = 49152  # SmolLM2's
EOS = 2


@pytest.fixture(scope="module")
def grammars():
    controls = SamplerControls(3, VOCAB, torch.device("cpu"))
    return Grammars(controls, None, cache_size=2, eos_token_ids=(EOS,))


def writes(*schemas: dict) -> executor_pb2.StepPlan:
    return executor_pb2.StepPlan(
        control_grammar=[executor_pb2.Grammar(json_schema=json.dumps(schema)) for schema in schemas]
    )


def test_grammars_compile_off_the_loop_into_a_bounded_map(grammars):
    async def compile_while_the_loop_turns() -> int:
        schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(3)]
        async with loop_turns() as turns:
            await grammars.compile_ahead(plan_grammars(writes(*schemas)))
        return turns()

    assert asyncio.run(compile_while_the_loop_turns()) > 0  # the loop ran while they compiled
    assert len(grammars._compiled) == 2  # the oldest of three dropped


def test_a_schema_xgrammar_cannot_compile_is_a_plan_error_in_words(grammars):
    """It names xgrammar's reason, without the time and C++ source position xgrammar puts before it."""
    bad = {"type": "string", "pattern": "(?<=a)b"}
    with pytest.raises(PlanError) as refused:
        asyncio.run(grammars.compile_ahead(plan_grammars(writes(bad))))
    assert str(refused.value) == (
        "control_grammar: the JSON schema cannot be compiled: Regex parsing error at position 3: "
        "Lookbehind is not supported yet."
    )


def test_a_refused_token_ends_only_its_row(grammars):
    grammars._matchers[1] = grammars._matcher("")  # any JSON object: '{' first
    forbidden = 5
    step = LaunchedStep(0, None, [], torch.tensor([forbidden]), None, 0)  # type: ignore[arg-type]
    grammars._unfed.append((step, np.array([1])))
    grammars.feed(None)
    assert 1 not in grammars._matchers
    words = grammars._controls.grammar_mask[1].numpy().view(np.uint32)
    allowed = [w * 32 + b for w in range(len(words)) for b in range(32) if words[w] >> b & 1]
    assert allowed == [EOS]
    assert (grammars._controls.grammar_mask[2] == -1).all()  # another slot untouched


def test_a_whitespace_run_longer_than_the_cap_is_masked(grammars):
    """json_object's grammar and a schema's (compiled as the planner checks them): a run of MAX_JSON_WHITESPACE
    spaces and newlines between tokens passes, one more does not, so a model cannot pad until max_tokens."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    for grammar in ("", schema):
        for run, taken in ((MAX_JSON_WHITESPACE, True), (MAX_JSON_WHITESPACE + 1, False)):
            whitespace = "\n" + " " * (run - 1)
            matcher = grammars._matcher(grammar)
            assert matcher.accept_string('{"a":' + whitespace) is taken, (grammar, run)
        pretty = grammars._matcher(grammar)  # pretty-printed, a run per line
        assert pretty.accept_string('{\n  "a": 1\n}') and pretty.accept_token(EOS) and pretty.is_terminated()


class _ReadBackHeld:
    """A launched step's `done` whose read-back holds its reader until released: a step still running."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
        self.entered.set()
        self.release.wait(10)


def test_steps_are_fed_once_and_in_order_from_two_threads(grammars):
    """On the CPU the loop feeds a collected step while the compute thread, launching a constrained step,
    feeds every step launched: the second waits for the first, and no step is fed twice or out of order."""
    held = _ReadBackHeld()
    first = LaunchedStep(1, None, [], torch.tensor([11]), held, 0)  # type: ignore[arg-type]
    second = LaunchedStep(2, None, [], torch.tensor([12]), None, 0)
    grammars._unfed += [(first, np.array([2])), (second, np.array([2]))]
    collecting = threading.Thread(target=grammars.feed, args=(first,))
    collecting.start()
    assert held.entered.wait(10)
    launching = threading.Thread(target=grammars.feed, args=(None,))
    launching.start()
    launching.join(0.2)
    assert launching.is_alive() and held.waits == 1  # it waits for the feed under way, not on its step
    held.release.set()
    collecting.join(10)
    launching.join(10)
    assert held.waits == 1 and not grammars._unfed
    assert grammars._last[2] == 12  # the second step's token came last


def test_a_plan_of_several_steps_leaves_each_row_its_last_step_token(grammars):
    """A plan of three decode steps over slots 1 and 2 (no grammar among them: the executor refuses several
    steps over constrained rows): a grammar written later with the device's loop-back token reads the last."""
    step = LaunchedStep(3, None, [], torch.tensor([21, 22, 31, 32, 41, 42]), None, 0)  # type: ignore[arg-type]
    grammars._unfed.append((step, np.array([1, 2])))
    grammars.feed(None)
    assert grammars._last[[1, 2]].tolist() == [41, 42]


# Registered before grammars.py is imported, so it runs after that module's own exit hook (atexit is LIFO), the
# last thing before finalization: a warm build's thread still alive here would be unwound out of xgrammar.
_EXIT_AT_ONCE = """
import atexit, threading

atexit.register(lambda: print("alive at exit:", [t.name for t in threading.enumerate() if t.name == "grammar-compiler"]))
import torch
from executor_svc.grammars import Grammars
from executor_svc.sampler_controls import SamplerControls

Grammars(SamplerControls(1, 49152, torch.device("cpu")), None, warm=True)
"""


def test_a_process_exiting_while_the_warm_build_runs_waits_for_it():
    """An executor stopped right after start exits with xgrammar's warm build under way: its daemon thread, still
    in xgrammar's import when the interpreter finalized, aborted the process ("terminate called without an
    active exception"). The exit now joins it first."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_AT_ONCE],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "alive at exit: []" in done.stdout, done.stdout + done.stderr
    assert "terminate called" not in done.stderr


def test_a_warm_builds_thread_stays_where_the_exit_joins_it_until_it_has_ended():
    """The thread left the set the exit joins as its build ended, before the thread itself ended: ending, it
    dropped its target, a bound method holding the last reference to a stopped executor's Grammars, and freed
    their tensors while the interpreter finalized (the same abort, through torch; one exit in five of
    tests/test_reasoning.py)."""
    from executor_svc import grammars as module

    before = set(module._warming)
    made = Grammars(SamplerControls(1, 49152, torch.device("cpu")), None, warm=True)
    [thread] = module._warming - before
    assert made._compiler is not None
    made._compiler.result(timeout=120)
    thread.join(120)
    assert thread in module._warming  # joined at exit (at once, now that it has ended)
