"""Decode graphs: the host-planned arm's host rows and plan inputs, and the graph
step (resident and host-planned) against the eager runner, eagerly on the CPU under TRITON_INTERPRET=1;
capture, replay and FlashInfer on a GPU (skipped here, with the reason)."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from executor_svc.kernels import interpreting, triton_available

if not triton_available():
    pytest.skip("triton cannot run here: no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)

from executor_svc.attention import decode_attention
from executor_svc.attention.host_planned import HostRows, plan_from_rows
from executor_svc.config import ExecutorConfig
from executor_svc.decode_graphs import DecodeGraphs, capture_order
from executor_svc.kernels.attention import paged_decode_attention
from executor_svc.kv_pool import KVPool
from executor_svc.models.dense import DenseModel
from executor_svc.prefill.batch import PrefillShape
from executor_svc.row_runs import row_writes
from executor_svc.runner import StepRunner, runner_for_model
from executor_svc.slot_store import GREEDY, SAMPLED, SlotStore
from protos.layout import RowLayout
from protos.wire import unpack_i32
from tests.runner_script import (
    BUCKETS,
    LAYOUT,
    PAGE,
    POOL_PAGES,
    TINY,
    reference_tokens,
    run_script,
    scripted_plans,
    without_timing,
)

DEVICE = torch.device("cpu" if interpreting() else "cuda")
KV_LEN, POS_OFFSET, BLOCK_TABLE = RowLayout.KV_LEN, RowLayout.POS_OFFSET, RowLayout.BLOCK_TABLE
# Triton's dot needs a head_dim of at least 16; the rest is runner_script.py's tiny model, so its scripts apply.
GRAPH_TINY = dataclasses.replace(TINY, head_dim=16)
needs_gpu = pytest.mark.skipif(interpreting(), reason="CUDA graphs and compiled kernels need a GPU")


def tiny_model(device: torch.device, dtype: torch.dtype = torch.float32, config=GRAPH_TINY) -> DenseModel:
    """Random weights drawn on the CPU, so every device gets the same model."""
    model = DenseModel(config, device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.3
            noise = scale * torch.randn(param.shape, generator=generator)
            param.copy_((1.0 + noise) if name.endswith("norm.weight") else noise)
    return model


def graph_runner(model: DenseModel, decode_path: str, prefill_buckets: tuple[int, ...] = ()) -> StepRunner:
    store = SlotStore(LAYOUT, model.device, model.config.vocab_size)
    kv = model.make_kv_pool(POOL_PAGES, PAGE)
    max_seq_len = model.config.max_seq_len
    attention = decode_attention(decode_path, model, kv, store, BUCKETS, max_seq_len)
    graphs = DecodeGraphs(model, store, attention, BUCKETS)
    prefill_graphs = None
    if prefill_buckets:
        from executor_svc.prefill.graphs import PrefillGraphs  # CUDA only

        prefill_graphs = PrefillGraphs(
            model, kv, store, prefill_buckets, max_seq_len=max_seq_len, pool=graphs.pool
        )
    return StepRunner(
        model,
        kv,
        store,
        LAYOUT,
        True,
        buckets=BUCKETS,
        fingerprint="tiny",
        graphs=graphs,
        prefill_graphs=prefill_graphs,
    )


# --- pure pieces --------------------------------------------------------------------------------------


def test_capture_goes_widest_first():
    assert capture_order([4, 1, 16, 2, 4]) == [16, 4, 2, 1]


def test_prefill_buckets_are_shaped_for_what_a_step_can_hold():
    from executor_svc.prefill.graphs import bucket_shapes, smallest_holding

    shapes = bucket_shapes([2048, 64, 512], widest=256, max_seq_len=1000, page_size=16)
    assert [(s.tokens, s.chunks, s.samples, s.table_width) for s in shapes] == [
        (64, 64, 64, 63),
        (512, 257, 256, 63),
        (2048, 257, 256, 63),
    ]
    assert (
        smallest_holding(shapes, PrefillShape(tokens=300, chunks=2, samples=2, table_width=40)).tokens == 512
    )
    assert (
        smallest_holding(shapes, PrefillShape(tokens=64, chunks=64, samples=64, table_width=63)).tokens == 64
    )
    assert (
        smallest_holding(shapes, PrefillShape(tokens=64, chunks=65, samples=1, table_width=4)).tokens == 512
    )
    assert (
        smallest_holding(shapes, PrefillShape(tokens=2049, chunks=1, samples=1, table_width=4)) is None
    )  # eager
    assert smallest_holding(shapes, PrefillShape(tokens=10, chunks=1, samples=1, table_width=64)) is None


def test_recurrent_prefill_buckets_hold_a_few_sequences_and_sample_no_more():
    from executor_svc.prefill.graphs import bucket_shapes, smallest_holding

    shapes = bucket_shapes([2048, 64, 512], widest=256, max_seq_len=1000, page_size=16, recurrent=True)
    assert [(s.tokens, s.chunks, s.samples) for s in shapes] == [(64, 4, 4), (512, 4, 4), (2048, 16, 16)]
    five = PrefillShape(tokens=300, chunks=5, samples=5, table_width=40)
    assert smallest_holding(shapes, five).tokens == 2048


def test_decode_path_is_checked():
    assert ExecutorConfig().decode_path == "resident"
    with pytest.raises(ValueError, match="decode_path must be resident or host-planned"):
        ExecutorConfig(decode_path="planned")


def test_host_planned_needs_cuda():
    if DEVICE.type == "cuda":
        pytest.skip("the refusal is for CPU runners")
    with pytest.raises(ValueError, match="host-planned needs a CUDA device"):
        runner_for_model(tiny_model(DEVICE), ExecutorConfig(device="cpu", decode_path="host-planned"), "tiny")


def test_host_plan_inputs_from_rows():
    layout = RowLayout(slots=9, block_span=4)
    rows = np.zeros((layout.slots, layout.columns), dtype=np.int32)
    rows[3] = [8, 2, 3, 11, 12, 13, 0]  # 8 stored of page 4: the step's token starts page 3 (13)
    rows[5] = [5, 0, 5, 21, 22, 0, 0]  # 5 stored: the step writes offset 1 of page 22
    plan = plan_from_rows(rows, np.array([3, 0, 5], dtype=np.int32), page_size=4, max_seq_len=16)
    np.testing.assert_array_equal(plan.positions, [10, 0, 5])
    # Past the context, a row stays at the tables' last position (as the gather kernel keeps it).
    short = plan_from_rows(rows, np.array([3, 0, 5], dtype=np.int32), page_size=4, max_seq_len=10)
    np.testing.assert_array_equal(short.positions, [9, 0, 5])
    # A length grown past the span (steady steps run too long) reads the row's own pages, no more.
    rows[3, 0] = 20
    past = plan_from_rows(rows, np.array([3], dtype=np.int32), page_size=4, max_seq_len=16)
    np.testing.assert_array_equal(past.lengths, [16])
    np.testing.assert_array_equal(past.last_page_len, [4])
    np.testing.assert_array_equal(past.indptr, [0, 4])
    np.testing.assert_array_equal(plan.write_page, [13, 0, 22])
    np.testing.assert_array_equal(plan.write_offset, [0, 0, 1])
    np.testing.assert_array_equal(plan.lengths, [9, 1, 6])
    # FlashInfer's CSR: row 3 holds 3 pages, the padding row the sink page, row 5 two pages.
    np.testing.assert_array_equal(plan.indptr, [0, 3, 4, 6])
    np.testing.assert_array_equal(plan.indices, [11, 12, 13, 0, 21, 22])
    np.testing.assert_array_equal(plan.last_page_len, [1, 1, 2])
    np.testing.assert_array_equal(plan.tables, rows[[3, 0, 5], BLOCK_TABLE:])


def test_host_rows_follow_the_slot_store():
    layout = RowLayout(slots=9, block_span=4)
    store, host = SlotStore(layout, torch.device("cpu")), HostRows(layout)
    c = layout.columns
    slots = np.array([2, 0, 4, 1], dtype=np.int32)
    # Two whole rows joined into one run, a run of a row's tail, repeated one-cell runs (the last wins).
    runs = np.array([2, 0, 2 * c, *range(2 * c), 4, 3, 2, 50, 51], dtype=np.int32)
    cells = [2, KV_LEN, 1, 6, 4, BLOCK_TABLE + 3, 1, 13, 2, KV_LEN, 1, 16]
    writes = row_writes(np.concatenate([runs, np.array(cells, dtype=np.int32)]), c)
    store.set_slots(slots)
    store.write_runs(writes)
    host.apply(writes)
    np.testing.assert_array_equal(host.rows, store.rows.numpy())
    store.advance(4)
    host.advance(slots)
    np.testing.assert_array_equal(host.rows, store.rows.numpy())
    assert not host.rows[0].any()


# --- the graph step, eager on the CPU (and captured on a GPU) ------------------------------------------


@pytest.mark.parametrize("decode_path", ["resident", "host-planned"])
def test_graph_steps_equal_the_model_called_directly(decode_path: str):
    if decode_path == "host-planned" and DEVICE.type == "cuda":
        pytest.skip("on a GPU the host-planned arm is FlashInfer's, whose JIT kernels need head_dim >= 64")
    model = tiny_model(DEVICE)
    runner = graph_runner(model, decode_path)
    expected_state = "captured" if DEVICE.type == "cuda" else "eager (no CUDA graphs on this device)"
    assert all(state.startswith(expected_state) for state in runner.graphs.states.values())
    # Row check on (after the replay); A, B prefilled, then decoded in a padded bucket with crossings.
    assert run_script(runner, [2, 0, 1, 0]) == reference_tokens(model)
    assert runner.store.rows[0].abs().sum() == 0 and runner.store.last_token[0] == 0
    assert runner.times.steps == 5


# Each dense variant's kernel path (Qwen3's q/k norms; biases in every projection, fused or not; yarn's
# frequencies and attention factor in the rope tables) against its torch path.
DENSE_VARIANTS = {
    "qk_norm": dict(qk_norm=True),
    "biases": dict(attention_bias=True, mlp_bias=True),
    "scaled_rope": dict(
        rope_inv_freq=(1.0, 0.3, 0.05, 0.004, 0.002, 0.001, 0.0005, 0.0001), rope_attention_factor=1.2
    ),
}


@pytest.mark.parametrize("variant", sorted(DENSE_VARIANTS))
def test_resident_steps_of_each_dense_variant_equal_its_torch_model(variant: str):
    model = tiny_model(DEVICE, config=dataclasses.replace(GRAPH_TINY, **DENSE_VARIANTS[variant]))
    runner = graph_runner(model, "resident")
    assert run_script(runner, [2, 0, 1, 0]) == reference_tokens(model)


def test_steps_of_greedy_rows_take_the_argmax_graph():
    model = tiny_model(DEVICE)
    greedy_only, mixed = graph_runner(model, "resident"), graph_runner(model, "resident")
    got = run_script(greedy_only, [1, 0])  # A (greedy) decodes alone; B (sampled) only prefills
    assert greedy_only.store.variant(2) == GREEDY and got[1] == reference_tokens(model)[1]
    run_script(mixed, [1, 2])
    assert mixed.store.variant(2) == SAMPLED


def test_greedy_follows_the_plans_that_change_slots_or_sampling():
    """The greedy flag is kept across steady steps, and a plan that moves rows or rewrites a slot's sampler
    state changes it."""
    store = graph_runner(tiny_model(DEVICE), "resident").store
    sampled, greedy = np.array([[0.8, 1.0]], np.float32), np.array([[0.0, 1.0]], np.float32)
    keep_token = np.array([[0, 0, 0, -1]], np.int32)
    store.set_slots(np.array([1, 2], np.int32))
    assert store.variant(2) == GREEDY
    store.write_sampler(np.array([2], np.int32), sampled, keep_token)
    assert store.variant(2) == SAMPLED and store.variant(1) == GREEDY
    store.set_slots(np.array([1, 3], np.int32))  # slot 2 leaves the step
    assert store.variant(2) == GREEDY
    store.set_slots(np.array([2, 1], np.int32))
    assert store.variant(2) == SAMPLED
    store.write_sampler(np.array([2], np.int32), greedy, keep_token)
    assert store.variant(2) == GREEDY


def test_a_step_launched_before_the_last_is_collected_gives_the_same_outputs():
    """Step N+1 launches while step N's tokens are still on their way back (as the executor runs them)."""
    model = tiny_model(DEVICE)
    ahead, one_by_one = graph_runner(model, "resident"), graph_runner(model, "resident")
    plans = scripted_plans([2, 0, 1, 0])
    in_flight, outputs = [], []
    for plan in plans:
        in_flight.append(ahead.launch(plan))
        if len(in_flight) == 2:
            step = in_flight.pop(0)
            step.wait()
            outputs.append(ahead.collect(step))
    for step in in_flight:
        step.wait()
        outputs.append(ahead.collect(step))
    assert without_timing(outputs) == without_timing([one_by_one.run(plan) for plan in plans])
    assert all(output.row_mismatches == 0 for output in outputs)


def test_graph_padding_rows_change_nothing():
    model = tiny_model(DEVICE)
    narrow, padded = graph_runner(model, "resident"), graph_runner(model, "resident")
    assert run_script(narrow, [1, 2]) == run_script(padded, [0, 1, 0, 2])
    for name in ("rows", "last_token"):
        assert torch.equal(getattr(narrow.store, name), getattr(padded.store, name)), name


# --- GPU only --------------------------------------------------------------------------------------------


@needs_gpu
def test_every_bucket_is_captured_host_plan_free_and_replays_as_eager():
    model = tiny_model(DEVICE)
    runner = graph_runner(model, "resident")
    assert runner.graphs.states == {b: "captured, host-plan-free" for b in BUCKETS}
    eager = graph_runner(model, "resident")
    eager.graphs._graphs.clear()  # same step, run eagerly
    assert run_script(runner, [2, 0, 1, 0]) == run_script(eager, [2, 0, 1, 0])
    times = runner.times
    assert times.graph_us > 0
    # decode steps after decode steps: timed against the replay before them, never shorter than the graph
    assert times.steady_steps > 0 and times.steady_period_us >= times.steady_graph_us > 0


@needs_gpu
@pytest.mark.parametrize("prefill_buckets", [(16,), (8,)])
def test_prefill_replayed_from_its_graphs_gives_the_eager_tokens_and_pages(prefill_buckets: tuple[int, ...]):
    """(16,): both prefill steps replay (the first greedy, the second sampling); (8,): the first step's 11
    tokens fit no bucket and run eager, the second replays."""
    model = tiny_model(DEVICE)
    replayed = graph_runner(model, "resident", prefill_buckets)
    assert replayed.prefill_graphs.states == dict.fromkeys(prefill_buckets, "captured")
    eager = graph_runner(model, "resident")
    assert run_script(replayed, [2, 0, 1, 0]) == run_script(eager, [2, 0, 1, 0]) == reference_tokens(model)
    # the padding wrote only the sink page and slot
    torch.testing.assert_close(replayed.kv_pool.k[:, 1:], eager.kv_pool.k[:, 1:])
    torch.testing.assert_close(replayed.kv_pool.v[:, 1:], eager.kv_pool.v[:, 1:])
    assert replayed.store.last_token[0] == 0 and torch.equal(
        replayed.store.last_token, eager.store.last_token
    )


def prefill_beside_decode_plans() -> list:
    """A prefills, then decodes alone (bucket 1) while B's last prompt chunk runs in the same step as A's first
    decode: the step's decode replay runs between the prefill and the read-back of both."""
    plans = scripted_plans([1])
    first_decode = plans[2]
    first_decode.prefill.extend(plans[1].prefill)
    merged = [plans[0], first_decode, *plans[3:]]
    for seq, plan in enumerate(merged, start=1):
        plan.seq = seq
    return merged


@pytest.mark.parametrize("prefill_buckets", [(), pytest.param((16,), marks=needs_gpu)])
def test_prefill_beside_a_decode_step_gives_each_its_tokens(prefill_buckets: tuple[int, ...]):
    model = tiny_model(DEVICE)
    runner = graph_runner(model, "resident", prefill_buckets)
    got: dict[int, list[int]] = {1: [], 2: []}
    for plan in prefill_beside_decode_plans():
        output = runner.run(plan)
        assert output.row_mismatches == 0
        for chunk, token in zip(plan.prefill, unpack_i32(output.prefill_tokens), strict=True):
            if chunk.sample_slot:
                got[chunk.sample_slot].append(int(token))
        if plan.bucket:
            got[1].append(int(unpack_i32(output.tokens)[0]))
    expected = reference_tokens(model)
    assert got == {1: expected[1], 2: expected[2][:1]}


@needs_gpu
def test_flashinfer_attention_matches_the_resident_kernel():
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
    from executor_svc.attention.host_planned import FlashInferDecode

    # SmolLM2's attention shape (GQA 3:1, head_dim 64) in bf16, the build the benchmark uses.
    page, span, heads, kv_heads, head_dim = 16, 8, 9, 3, 64
    layout = RowLayout(slots=9, block_span=span)
    store = SlotStore(layout, DEVICE)
    rows = np.zeros((layout.slots, layout.columns), dtype=np.int32)
    rng = np.random.default_rng(0)
    for slot in range(1, layout.slots):
        rows[slot, KV_LEN] = rng.integers(0, span * page - 1)
        rows[slot, BLOCK_TABLE:] = rng.permutation(np.arange(1, 40))[:span]
    store.rows.copy_(torch.from_numpy(rows))
    slots = np.array([3, 0, 7, 1], dtype=np.int32)
    store.set_slots(slots)
    kv = KVPool(1, 40, page, kv_heads, head_dim, torch.bfloat16, DEVICE)
    kv.k.normal_()
    kv.v.normal_()
    q = torch.randn(4, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    scale = head_dim**-0.5
    resident = paged_decode_attention(
        q, kv.k[0], kv.v[0], store.rows, store.step_slots[:4], BLOCK_TABLE, page, scale
    )
    flashinfer = FlashInferDecode((4,), kv, heads, span, scale)
    flashinfer.plan(4, plan_from_rows(rows, slots, page, span * page))
    torch.testing.assert_close(flashinfer.attend(4, 0, q), resident, atol=2e-2, rtol=2e-2)
