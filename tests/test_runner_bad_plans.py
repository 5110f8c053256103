"""The step runner on a tiny random Llama, given plans it must not run as sent: malformed plans and several
steps over rows with sampling controls are refused and change nothing; rows past the context step
clamped and leave the runner whole."""

from __future__ import annotations

import re

import pytest
import torch

from executor_svc.models.dense import DenseModel
from executor_svc.plan import PlanError
from protos import executor_pb2
from protos.wire import pack_f32, pack_i32, unpack_i32
from tests.runner_script import (
    KV_LEN,
    LAYOUT,
    SAMPLING_A,
    pack_runs,
    prefill_chunk,
    sampler_fields,
    scripted_plans,
    steady_from_written_rows,
    tiny_runner,
    whole_row,
)


def test_several_steps_over_rows_with_sampling_controls_are_refused(tiny_llama: DenseModel):
    runner = tiny_runner(tiny_llama)
    seq = steady_from_written_rows(runner)
    # min_p on slot 1: its rows run the CONTROLLED sampler, whose logprobs and grammars go one step a plan
    controls = dict(
        control_slots=pack_i32([1]),
        control_f32=pack_f32([(0.05, 1.0, 0.0, 0.0)]),
        control_i32=pack_i32([(0, 0, -1, 0, 0, 0, 0)]),
    )
    runner.run(executor_pb2.StepPlan(seq=seq, bucket=2, **sampler_fields([SAMPLING_A]), **controls))
    rows = runner.store.rows.clone()
    with pytest.raises(PlanError, match="steps: 2 over rows with sampling controls"):
        runner.run(executor_pb2.StepPlan(seq=seq + 1, bucket=2, steps=2))
    assert torch.equal(runner.store.rows, rows)
    assert len(unpack_i32(runner.run(executor_pb2.StepPlan(seq=seq + 1, bucket=2)).tokens)) == 2


BAD_PLANS = [
    (dict(bucket=3), "bucket 3 is not one of the buckets"),
    (dict(bucket=2, slots=pack_i32([1])), "1 slots for bucket 2"),
    (dict(bucket=2, slots=pack_i32([1, 9])), "slot 9 is outside [0, 9)"),
    (dict(bucket=2, slots=pack_i32([3, 3])), "slot 3 appears more than once"),
    (dict(bucket=1), "bucket 1 differs from the rows held (bucket 2)"),
    (dict(slots=b"\x01\x00\x00"), "3 bytes is not a whole number of int32"),
    (dict(row_runs=pack_runs((0, [0, 0, 0]))), "row_runs: slot 0 is outside [1, 9)"),
    (dict(row_runs=pack_i32([1, 19, 1, 0])), "row_runs: column 19 is outside [0, 19)"),
    (dict(row_runs=pack_i32([8, 5, 15, *[0] * 15])), "runs past the last row"),
    (dict(row_runs=pack_i32([1, 0, 4, 0, 0])), "bytes end first"),
    (dict(row_runs=pack_runs((1, [3, 0, 0, 32]))), "block-table page value 32 is outside [0, 32)"),
    # A decode row's token goes to position KV_LEN + POS_OFFSET, so a full context is no room for it.
    (dict(row_runs=pack_i32([1, KV_LEN, 1, 64])), "KV_LEN value 64 is outside [0, 64)"),
    (dict(row_runs=pack_i32([1, KV_LEN + 1, 1, 64])), "POS_OFFSET value 64 is outside [0, 64)"),
    (
        dict(sampler_slots=pack_i32([1]), sampler_f32=pack_f32([1.0]), sampler_i32=pack_i32([0, 0, 0, -1])),
        "1 slots need 8 bytes of sampler_f32",
    ),
    (sampler_fields([(1, -0.5, 1.0, 0, 0)]), "temperature must be finite and >= 0"),
    (sampler_fields([(1, 1.0, 0.0, 0, 0)]), "top_p must be in (0, 1]"),
    (sampler_fields([(1, float("inf"), 1.0, 0, 0)]), "temperature must be finite and >= 0, got [inf]"),
    (sampler_fields([(1, float("nan"), 1.0, 0, 0)]), "temperature must be finite and >= 0, got [nan]"),
    (sampler_fields([(1, 1.0, float("nan"), 0, 0)]), "top_p must be in (0, 1], got [nan]"),
    (sampler_fields([(1, 1.0, float("inf"), 0, 0)]), "top_p must be in (0, 1], got [inf]"),
    (sampler_fields([(1, 1.0, 1.0, -2, 0)]), "top_k must be >= 0"),
    (dict(prefill=[prefill_chunk([1, 64], 0, [1], 0)]), "token id 64 is outside the vocabulary"),
    (dict(prefill=[prefill_chunk([1] * 5, 0, [1], 0)]), "need 2 pages of 4, got 1"),
    (dict(prefill=[prefill_chunk([1], 0, [0], 0)]), "page 0 is outside [1, 32)"),
    (
        dict(prefill=[prefill_chunk([1], 63, [1] * 16, 0), prefill_chunk([1, 2], 63, [1] * 17, 0)]),
        "prefill[1]: positions [63, 65) are outside [0, 64)",
    ),
    (dict(prefill=[prefill_chunk([1], 0, [1], 9)]), "sample_slot 9 is outside [0, 9)"),
    (
        dict(prefill=[prefill_chunk([1], 0, [1], 3), prefill_chunk([2], 0, [2], 3)]),
        "prefill sample_slot: slot 3 appears more than once",
    ),
    (
        dict(prefill=[prefill_chunk([1], 0, [1], 0) for _ in range(6)]),
        "prefill: 6 chunks, more than a step can hold (5)",
    ),
    (
        dict(prefill=[prefill_chunk([1] * 64, 0, [1] * 16, 0)] * 2 + [prefill_chunk([1], 0, [1], 0)]),
        "prefill: 129 tokens, more than the KV pool holds (128)",
    ),
    (
        dict(prefill=[prefill_chunk([1], 0, [1], slot) for slot in range(1, 6)]),
        "prefill: 5 chunks sample, more than the widest bucket (4)",
    ),
    (dict(bucket=1, slots=pack_i32([1]), mirror=pack_i32([0] * 18)), "mirror: 72 bytes, expected 76"),
    (dict(bucket=2, steps=17), "steps: 17, more than 16"),
    (dict(bucket=2, steps=2), "steps: 2 for a plan that is not a steady decode step"),
]


def test_rows_past_the_context_step_clamped_and_leave_the_runner_whole(tiny_llama: DenseModel):
    """Steady steps grow lengths on the device, where no host check sees them, and a row's KV_LEN and
    POS_OFFSET may each be in range while their sum is not: such rows run at the tables' last position and
    write their span's end to the sink page. Nothing indexes past a table, so the step and the next work."""
    runner = tiny_runner(tiny_llama)
    for plan in scripted_plans([1, 2])[:2]:
        runner.run(plan)
    every_page = list(range(1, LAYOUT.block_span + 1))
    near_the_end = executor_pb2.StepPlan(
        seq=3, bucket=1, slots=pack_i32([1]), row_runs=pack_runs((1, whole_row(60, every_page)))
    )
    runner.run(near_the_end)
    runner.run(executor_pb2.StepPlan(seq=4, bucket=1, steps=16))  # 61 -> 77: past the 64 positions
    assert int(runner.store.rows[1, KV_LEN]) == 77
    offset_past = executor_pb2.StepPlan(seq=5, bucket=1, row_runs=pack_runs((1, [6, 60, 0, 3, 4])))
    runner.run(offset_past)  # position 66
    fresh = tiny_runner(tiny_llama)
    for plan, expected in zip(scripted_plans([1, 2]), map(fresh.run, scripted_plans([1, 2]))):
        plan.seq += 5
        assert runner.run(plan).tokens == expected.tokens


@pytest.mark.parametrize(("fields", "message"), BAD_PLANS, ids=[message for _, message in BAD_PLANS])
def test_malformed_plans_are_refused_and_change_nothing(tiny_llama: DenseModel, fields: dict, message: str):
    runner = tiny_runner(tiny_llama)
    for plan in scripted_plans([1, 2])[:3]:
        runner.run(plan)
    state = {
        name: getattr(runner.store, name).clone()
        for name in ("rows", "last_token", "temperature", "top_p", "top_k", "seed", "step_slots")
    }
    k, v = runner.kv_pool.k.clone(), runner.kv_pool.v.clone()
    # Valid writes ride along with the bad field: none of them may land.
    plan = executor_pb2.StepPlan(
        seq=9,
        row_runs=pack_runs((3, [5, 0, 0, 1, 2])),
        prefill=[prefill_chunk([4, 5], 0, [20], 4)],
        **sampler_fields([(4, 0.5, 1.0, 0, 9)]),
    )
    if "sampler_slots" in fields or "sampler_f32" in fields:
        plan.ClearField("sampler_slots"), plan.ClearField("sampler_f32"), plan.ClearField("sampler_i32")
    if "prefill" in fields:
        plan.ClearField("prefill")
    plan.MergeFrom(executor_pb2.StepPlan(**fields))
    with pytest.raises(PlanError, match=re.escape(message)):
        runner.run(plan)
    for name, before in state.items():
        assert torch.equal(getattr(runner.store, name), before), name
    assert torch.equal(runner.kv_pool.k, k) and torch.equal(runner.kv_pool.v, v)
    # The runner still takes good plans afterwards: the next decode step of the script.
    assert runner.run(scripted_plans([1, 2])[3]).row_mismatches == 0
