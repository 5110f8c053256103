"""The step runner on a tiny random Llama: plans equal direct calls; padding rows change nothing; a step is
collected by polling; a plan of several steps equals as many steady ones; the row check counts
mismatches; what the runner describes (and the planner's end-of-sequence ids from it); device and dtype
resolution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.device import resolve_device, resolve_dtype
from executor_svc.models.dense import DenseModel
from executor_svc.step_loop import collect_when_ready
from protos import executor_pb2
from protos.wire import unpack_i32
from tests.loop_turns import loop_turns
from tests.runner_script import (
    DECODE_STEPS,
    KV_LEN,
    PAGE,
    POOL_PAGES,
    PROMPT_A,
    PROMPT_B,
    TINY,
    reference_tokens,
    run_script,
    scripted_plans,
    steady_from_written_rows,
    tiny_runner,
)


def test_plans_equal_calling_the_model_directly(tiny_llama: DenseModel):
    runner = tiny_runner(tiny_llama)
    assert run_script(runner, [2, 0, 1, 0]) == reference_tokens(tiny_llama)
    assert runner.store.rows[1, KV_LEN] == len(PROMPT_A) + DECODE_STEPS
    assert runner.store.rows[2, KV_LEN] == len(PROMPT_B) + DECODE_STEPS


def test_padding_rows_change_nothing(tiny_llama: DenseModel):
    narrow, padded = tiny_runner(tiny_llama), tiny_runner(tiny_llama)
    assert run_script(narrow, [1, 2]) == run_script(padded, [0, 1, 0, 2])
    for name in ("rows", "last_token", "temperature", "top_p", "top_k", "seed"):
        assert torch.equal(getattr(narrow.store, name), getattr(padded.store, name)), name
    assert not padded.store.rows[0].any() and padded.store.last_token[0] == 0
    # Every page but the sink page (where padding rows write) holds the same K/V, up to the rounding
    # a wider matmul brings.
    torch.testing.assert_close(narrow.kv_pool.k[:, 1:], padded.kv_pool.k[:, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(narrow.kv_pool.v[:, 1:], padded.kv_pool.v[:, 1:], rtol=1e-5, atol=1e-5)


class _EventDoneAfter:
    """The `done` of a launched step, done after a number of queries (what a CUDA event does on a GPU)."""

    def __init__(self, queries: int) -> None:
        self.queries_left = queries

    def query(self) -> bool:
        self.queries_left -= 1
        return self.queries_left < 0


async def test_collecting_a_step_polls_it_and_leaves_the_loop_free(tiny_llama: DenseModel):
    runner = tiny_runner(tiny_llama)
    plans = scripted_plans([1, 2])
    for plan in plans[:3]:
        runner.run(plan)
    step = runner.launch(plans[3])
    step.done = _EventDoneAfter(queries=5)
    async with loop_turns() as turns:
        output = await collect_when_ready(runner, step)
    assert step.done.queries_left < 0  # polled until done
    assert turns() >= 5  # the loop ran other tasks between polls
    assert output.seq == plans[3].seq and len(unpack_i32(output.tokens)) == 2


def test_a_plan_of_several_steps_equals_as_many_steady_plans(tiny_llama: DenseModel):
    one_each, joined = tiny_runner(tiny_llama), tiny_runner(tiny_llama)
    seq = steady_from_written_rows(one_each)
    assert steady_from_written_rows(joined) == seq
    singles = [
        unpack_i32(one_each.run(executor_pb2.StepPlan(seq=seq + i, bucket=2)).tokens) for i in range(3)
    ]
    output = joined.run(executor_pb2.StepPlan(seq=seq, bucket=2, steps=3))
    assert unpack_i32(output.tokens).tolist() == np.concatenate(singles).tolist()  # step after step
    assert torch.equal(one_each.store.rows, joined.store.rows)
    assert torch.equal(one_each.store.last_token, joined.store.last_token)
    assert torch.equal(one_each.kv_pool.k, joined.kv_pool.k)


def test_row_check_counts_cells_that_differ_from_the_mirror(tiny_llama: DenseModel):
    runner = tiny_runner(tiny_llama)
    plans = scripted_plans([1, 2])
    for plan in plans[:2]:
        runner.run(plan)
    mirror = unpack_i32(plans[2].mirror).copy()
    mirror[KV_LEN] += 1
    mirror[-1] = 7
    plans[2].mirror = mirror.tobytes()
    assert runner.run(plans[2]).row_mismatches == 2


def test_describe(tiny_llama: DenseModel):
    described = tiny_runner(tiny_llama).describe()
    assert described.model_name == "tiny-llama" and described.model_fingerprint == "tiny"
    assert (described.vocab_size, described.max_seq_len, described.num_layers) == (64, 64, 2)
    assert (described.page_size, described.pool_pages, list(described.buckets)) == (
        PAGE,
        POOL_PAGES,
        [1, 2, 4],
    )
    assert (described.slots, described.row_columns, described.block_span) == (9, 19, 16)
    assert (described.dtype, described.layer_begin, described.layer_end) == ("float32", 0, 2)
    assert described.device == str(tiny_llama.device)
    assert (
        described.eos_token_id == TINY.eos_token_ids[0]
        and tuple(described.eos_token_ids) == TINY.eos_token_ids
    )


def test_planner_stops_on_the_models_own_eos(tiny_llama: DenseModel):
    """The end-of-sequence id comes from the model's metadata, not from whatever the tokenizer reports."""
    from types import SimpleNamespace

    from planner_svc.server import PlannerServicer

    described = tiny_runner(tiny_llama).describe()
    eos = TINY.eos_token_ids[0]
    other_tokenizer = SimpleNamespace(eos_token_id=eos + 1)
    assert PlannerServicer([], [described], other_tokenizer, turns=None).eos_token_ids == (eos,)
    described.eos_token_ids[:] = [eos, 7, 9]  # a model with several: every one stops
    assert PlannerServicer([], [described], other_tokenizer, turns=None).eos_token_ids == (eos, 7, 9)
    described.ClearField("eos_token_ids")  # an executor that predates the list: its single id
    assert PlannerServicer([], [described], other_tokenizer, turns=None).eos_token_ids == (eos,)
    described.ClearField("eos_token_id")  # an executor that does not say: the tokenizer's
    assert PlannerServicer([], [described], other_tokenizer, turns=None).eos_token_ids == (eos + 1,)


def test_device_and_dtype_resolution():
    auto = resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", auto) == (torch.bfloat16 if auto.type == "cuda" else torch.float32)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:0")
