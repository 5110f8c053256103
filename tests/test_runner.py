"""The step runner on a tiny random Llama: plans equal direct calls; padding and bad plans change nothing."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import torch

from executor_svc.device import resolve_device, resolve_dtype
from executor_svc.models.dense import DenseModel
from executor_svc.plan import PlanError
from executor_svc.runner import StepRunner
from executor_svc.sampler import sample
from executor_svc.slot_store import SlotStore
from executor_svc.step_loop import collect_when_ready
from protos import executor_pb2
from protos.layout import RowLayout
from protos.wire import pack_f32, pack_i32, unpack_i32
from tests.conftest import decode_logits, prefill_logits, tiny_llama_config

PAGE = 4
POOL_PAGES = 32
BUCKETS = (1, 2, 4)
TINY = tiny_llama_config()
LAYOUT = RowLayout.build(list(BUCKETS), TINY.max_seq_len, PAGE, POOL_PAGES)  # 9 slots of 3 + 16 columns
KV_LEN, BLOCK_TABLE = RowLayout.KV_LEN, RowLayout.BLOCK_TABLE
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny_model(seed: int = 0, device: str = "cpu") -> DenseModel:
    """Random weights drawn on the CPU, so every device gets the same model."""
    model = DenseModel(TINY, device=device, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model


def tiny_runner(model: DenseModel) -> StepRunner:
    """A runner with the row check on, over a fresh KV pool and slot store."""
    store = SlotStore(LAYOUT, model.device, model.config.vocab_size)
    kv = model.make_kv_pool(POOL_PAGES, PAGE)
    return StepRunner(model, kv, store, LAYOUT, True, buckets=BUCKETS, fingerprint="tiny")


def whole_row(kv_len: int, pages: list[int]) -> list[int]:
    return [kv_len, 0, 0, *pages]


def as_i32(value: int) -> int:
    """A uint32 as the int32 with the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def pack_runs(*rows: tuple[int, list[int]]) -> bytes:
    return pack_i32([v for slot, cells in rows for v in (slot, 0, len(cells), *cells)])


def sampler_fields(rows: list[tuple[int, float, float, int, int]]) -> dict[str, bytes]:
    """rows: (slot, temperature, top_p, top_k, seed); the loop-back token is kept (-1)."""
    return dict(
        sampler_slots=pack_i32([r[0] for r in rows]),
        sampler_f32=pack_f32([(r[1], r[2]) for r in rows]),
        sampler_i32=pack_i32(
            [(r[3], as_i32(r[4] & 0xFFFFFFFF), as_i32(r[4] >> 32 & 0xFFFFFFFF), -1) for r in rows]
        ),
    )


def prefill_chunk(
    ids: list[int], start: int, pages: list[int], sample_slot: int
) -> executor_pb2.PrefillChunk:
    return executor_pb2.PrefillChunk(
        token_ids=pack_i32(ids), start=start, pages=pack_i32(pages), sample_slot=sample_slot
    )


# Two sequences: A (slot 1, greedy) prefills in one chunk; B (slot 2, seeded) in two chunks over two steps.
PROMPT_A = [5, 17, 3, 40, 22, 9]
PROMPT_B = [1, 33, 7, 7, 60, 12, 45, 2, 30]
PAGES_A = [3, 4, 5, 6]
PAGES_B = [10, 11, 12, 13, 14]
SAMPLING_A = (1, 0.0, 1.0, 0, 0)
SAMPLING_B = (2, 0.9, 0.95, 20, 1234)
DECODE_STEPS = 5


def decode_pages(kv_len: int, pages: list[int]) -> list[int]:
    """The pages a row holds before decoding at kv_len: those covering [0, kv_len + 1)."""
    return pages[: kv_len // PAGE + 1]


def scripted_plans(slots: list[int]) -> list[executor_pb2.StepPlan]:
    """Prefill A and B, then decode steps over `slots` (A at slot 1, B at slot 2, zeros pad).

    Rows go whole at the first decode step, holding only the pages they need; each page crossing
    after that is a run of one cell.
    """
    bucket = len(slots)
    plans = [
        executor_pb2.StepPlan(
            seq=1,
            prefill=[
                prefill_chunk(PROMPT_A, 0, PAGES_A[:2], 1),
                prefill_chunk(PROMPT_B[:5], 0, PAGES_B[:2], 0),
            ],
            **sampler_fields([SAMPLING_A, SAMPLING_B]),
        ),
        executor_pb2.StepPlan(seq=2, prefill=[prefill_chunk(PROMPT_B[5:], 5, PAGES_B[:3], 2)]),
    ]
    lens = {1: len(PROMPT_A), 2: len(PROMPT_B)}
    pages = {1: PAGES_A, 2: PAGES_B}
    for step in range(DECODE_STEPS):
        plan = executor_pb2.StepPlan(seq=3 + step, bucket=bucket)
        if step == 0:
            plan.slots = pack_i32(slots)
            plan.row_runs = pack_runs(
                *((s, whole_row(lens[s], decode_pages(lens[s], pages[s]))) for s in (1, 2))
            )
        else:
            crossings = [
                (s, BLOCK_TABLE + lens[s] // PAGE, pages[s][lens[s] // PAGE])
                for s in (1, 2)
                if lens[s] % PAGE == 0
            ]
            if crossings:
                plan.row_runs = pack_i32([v for slot, col, page in crossings for v in (slot, col, 1, page)])
        mirror = np.zeros((bucket, LAYOUT.columns), dtype=np.int32)
        for row, slot in enumerate(slots):
            if slot:
                held = decode_pages(lens[slot], pages[slot])
                mirror[row, : RowLayout.NARROW + len(held)] = whole_row(lens[slot], held)
        plan.mirror = mirror.tobytes()
        plans.append(plan)
        lens = {s: n + 1 for s, n in lens.items()}
    return plans


def reference_tokens(model: DenseModel) -> dict[int, list[int]]:
    """Each sequence on its own through the model and the sampler, batch of one."""
    kv = model.make_kv_pool(POOL_PAGES, PAGE)
    device = model.device
    out = {}
    for (slot, temperature, top_p, top_k, seed), prompt, pages in (
        (SAMPLING_A, PROMPT_A, PAGES_A),
        (SAMPLING_B, PROMPT_B, PAGES_B),
    ):
        params = (
            torch.tensor([temperature], device=device),
            torch.tensor([top_p], device=device),
            torch.tensor([top_k], dtype=torch.int32, device=device),
            torch.tensor([seed], device=device),
        )
        ids, page_ids = (
            torch.tensor(prompt, device=device),
            torch.tensor(pages, dtype=torch.int32, device=device),
        )
        logits = prefill_logits(model, kv, ids, 0, page_ids)
        tokens = [int(sample(logits[None], *params, torch.tensor([len(prompt)], device=device)))]
        table = torch.zeros(1, LAYOUT.block_span, dtype=torch.int32, device=device)
        table[0, : len(pages)] = page_ids
        for step in range(DECODE_STEPS):
            position = torch.tensor([len(prompt) + step], device=device)
            logits = decode_logits(
                model,
                kv,
                torch.tensor([tokens[-1]], device=device),
                position,
                position.to(torch.int32),
                table,
            )
            tokens.append(int(sample(logits, *params, position + 1)))
        out[slot] = tokens
    return out


@pytest.fixture(scope="module", params=DEVICES)
def model(request) -> DenseModel:
    return tiny_model(device=request.param)


def without_timing(outputs: list[executor_pb2.StepOutput]) -> list[executor_pb2.StepOutput]:
    """The outputs less what the device's timing decides (device_wait_us), to compare two runs."""
    bare = [executor_pb2.StepOutput.FromString(output.SerializeToString()) for output in outputs]
    for output in bare:
        output.ClearField("device_wait_us")
    return bare


def run_script(runner: StepRunner, slots: list[int]) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {1: [], 2: []}
    for plan in scripted_plans(slots):
        output = runner.run(plan)
        assert output.seq == plan.seq
        assert output.row_mismatches == 0
        for chunk, token in zip(plan.prefill, unpack_i32(output.prefill_tokens), strict=True):
            if chunk.sample_slot:
                got[chunk.sample_slot].append(int(token))
            else:
                assert token == -1
        tokens = unpack_i32(output.tokens)
        assert len(tokens) == plan.bucket
        for row, slot in enumerate(slots if plan.bucket else []):
            if slot:
                got[slot].append(int(tokens[row]))
    return got


def test_plans_equal_calling_the_model_directly(model: DenseModel):
    runner = tiny_runner(model)
    assert run_script(runner, [2, 0, 1, 0]) == reference_tokens(model)
    assert runner.store.rows[1, KV_LEN] == len(PROMPT_A) + DECODE_STEPS
    assert runner.store.rows[2, KV_LEN] == len(PROMPT_B) + DECODE_STEPS


def test_padding_rows_change_nothing(model: DenseModel):
    narrow, padded = tiny_runner(model), tiny_runner(model)
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


async def test_collecting_a_step_polls_it_and_leaves_the_loop_free(model: DenseModel):
    runner = tiny_runner(model)
    plans = scripted_plans([1, 2])
    for plan in plans[:3]:
        runner.run(plan)
    step = runner.launch(plans[3])
    step.done = _EventDoneAfter(queries=5)
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_turns())
    output = await collect_when_ready(runner, step)
    counter.cancel()
    assert step.done.queries_left < 0  # polled until done
    assert turns >= 5  # the loop ran other tasks between polls
    assert output.seq == plans[3].seq and len(unpack_i32(output.tokens)) == 2


def steady_from_written_rows(runner: StepRunner) -> int:
    """Prefill A and B, then a decode step writing both rows whole with every page they can write (bucket 2);
    returns the next seq."""
    for plan in scripted_plans([1, 2])[:2]:
        runner.run(plan)
    lens = {1: len(PROMPT_A), 2: len(PROMPT_B)}
    rows = ((1, whole_row(lens[1], PAGES_A)), (2, whole_row(lens[2], PAGES_B)))
    runner.run(executor_pb2.StepPlan(seq=3, bucket=2, slots=pack_i32([1, 2]), row_runs=pack_runs(*rows)))
    return 4


def test_a_plan_of_several_steps_equals_as_many_steady_plans(model: DenseModel):
    one_each, joined = tiny_runner(model), tiny_runner(model)
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


def test_several_steps_over_rows_with_sampling_controls_are_refused(model: DenseModel):
    runner = tiny_runner(model)
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


def test_row_check_counts_cells_that_differ_from_the_mirror(model: DenseModel):
    runner = tiny_runner(model)
    plans = scripted_plans([1, 2])
    for plan in plans[:2]:
        runner.run(plan)
    mirror = unpack_i32(plans[2].mirror).copy()
    mirror[KV_LEN] += 1
    mirror[-1] = 7
    plans[2].mirror = mirror.tobytes()
    assert runner.run(plans[2]).row_mismatches == 2


def test_describe(model: DenseModel):
    described = tiny_runner(model).describe()
    assert described.model_name == "tiny-llama" and described.model_fingerprint == "tiny"
    assert (described.vocab_size, described.max_seq_len, described.num_layers) == (64, 64, 2)
    assert (described.page_size, described.pool_pages, list(described.buckets)) == (
        PAGE,
        POOL_PAGES,
        [1, 2, 4],
    )
    assert (described.slots, described.row_columns, described.block_span) == (9, 19, 16)
    assert (described.dtype, described.layer_begin, described.layer_end) == ("float32", 0, 2)
    assert described.device == str(model.device)
    assert (
        described.eos_token_id == TINY.eos_token_ids[0]
        and tuple(described.eos_token_ids) == TINY.eos_token_ids
    )


def test_planner_stops_on_the_models_own_eos(model: DenseModel):
    """The end-of-sequence id comes from the model's metadata, not from whatever the tokenizer reports."""
    from types import SimpleNamespace

    from planner_svc.server import PlannerServicer

    described = tiny_runner(model).describe()
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


def test_rows_past_the_context_step_clamped_and_leave_the_runner_whole(model: DenseModel):
    """Steady steps grow lengths on the device, where no host check sees them, and a row's KV_LEN and
    POS_OFFSET may each be in range while their sum is not: such rows run at the tables' last position and
    write their span's end to the sink page. Nothing indexes past a table, so the step and the next work."""
    runner = tiny_runner(model)
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
    fresh = tiny_runner(model)
    for plan, expected in zip(scripted_plans([1, 2]), map(fresh.run, scripted_plans([1, 2]))):
        plan.seq += 5
        assert runner.run(plan).tokens == expected.tokens


@pytest.mark.parametrize(("fields", "message"), BAD_PLANS, ids=[message for _, message in BAD_PLANS])
def test_malformed_plans_are_refused_and_change_nothing(model: DenseModel, fields: dict, message: str):
    runner = tiny_runner(model)
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
