"""The slot store: row runs, sampler state, gather, advance, loop-back and the row check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_svc.plan import CheckedPlan
from executor_svc.row_runs import Run, Segment, join_runs, parse_runs, row_writes, run_cells
from executor_svc.slot_store import SlotStore
from protos.layout import RowLayout

LAYOUT = RowLayout(slots=9, block_span=4)  # B = 4, C = 7
C = LAYOUT.columns
KV_LEN, POS_OFFSET, BLOCK_TABLE = RowLayout.KV_LEN, RowLayout.POS_OFFSET, RowLayout.BLOCK_TABLE
# On CUDA the writes go through the pinned staging buffer and non-blocking copies.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def runs_of(*runs: tuple[int, int, list[int]]) -> np.ndarray:
    packed: list[int] = []
    for slot, first_col, cells in runs:
        packed += [slot, first_col, len(cells), *cells]
    return np.array(packed, dtype=np.int32)


def writes_of(*runs: tuple[int, int, list[int]]):
    """The runs parsed, as a checked plan holds them."""
    return row_writes(runs_of(*runs), C)


@pytest.fixture(params=DEVICES)
def store(request) -> SlotStore:
    return SlotStore(LAYOUT, torch.device(request.param))


def test_runs_that_continue_one_another_are_one_segment():
    packed = runs_of((2, 0, [5, 0, 0]), (2, 3, [7, 8]), (3, 0, [1]), (5, 1, [9]))
    parsed = parse_runs(packed)
    assert parsed == [Run(2, 0, 3, 3), Run(2, 3, 2, 9), Run(3, 0, 1, 14), Run(5, 1, 1, 18)]
    # Row 2's narrow cells and block-table cells join; row 3's run starts elsewhere (row 2 ends at col 5).
    assert join_runs(parsed, C) == [Segment(2 * C, 5), Segment(3 * C, 1), Segment(5 * C + 1, 1)]
    whole_rows = parse_runs(runs_of((1, 0, list(range(C))), (2, 0, list(range(C)))))
    assert join_runs(whole_rows, C) == [Segment(C, 2 * C)]


def test_run_cells_are_every_cell_of_the_runs_in_order():
    # A run continuing into the next row (from row 1's last column), then one inside row 4.
    packed = runs_of((1, C - 1, [10, 11, 12]), (4, 2, [20, 21]))
    cells = run_cells(packed, parse_runs(packed), C)
    assert cells.flat.tolist() == [2 * C - 1, 2 * C, 2 * C + 1, 4 * C + 2, 4 * C + 3]
    assert cells.values.tolist() == [10, 11, 12, 20, 21]
    nothing = run_cells(packed[:0], [], C)
    assert len(nothing.flat) == len(nothing.values) == 0


def test_truncated_runs_are_refused():
    with pytest.raises(ValueError, match="cut short"):
        parse_runs(np.array([1, 0], dtype=np.int32))
    with pytest.raises(ValueError, match="bytes end first"):
        parse_runs(np.array([1, 0, 3, 4, 5], dtype=np.int32))
    with pytest.raises(ValueError, match="at least one"):
        parse_runs(np.array([1, 0, 0], dtype=np.int32))


def test_write_runs(store: SlotStore):
    store.write_runs(writes_of((2, 0, [5, 0, 0]), (2, 3, [7, 8]), (4, 0, [3, 1, 0, 9, 10, 11, 12])))
    expected = np.zeros((LAYOUT.slots, C), dtype=np.int32)
    expected[2, :5] = [5, 0, 0, 7, 8]
    expected[4] = [3, 1, 0, 9, 10, 11, 12]
    np.testing.assert_array_equal(store.rows.cpu().numpy(), expected)


def test_gather_reads_rows_by_slot(store: SlotStore):
    store.write_runs(writes_of((3, 0, [5, 2, 0, 1, 2, 0, 0]), (6, 0, [17, 0, 0, 3, 4, 5, 0])))
    store.write_sampler(
        np.array([3, 6], dtype=np.int32),
        np.array([[0.7, 0.9], [0.0, 1.0]], dtype=np.float32),
        np.array([[40, 11, 0, 101], [0, 12, 0, 202]], dtype=np.int32),
    )
    store.set_slots(np.array([6, 0, 3], dtype=np.int32))
    inputs = store.gather(3)
    assert inputs.tokens.tolist() == [202, 0, 101]
    assert inputs.positions.tolist() == [17, 0, 7]
    assert inputs.kv_lens.tolist() == [17, 0, 5]
    assert inputs.block_tables.tolist() == [[3, 4, 5, 0], [0, 0, 0, 0], [1, 2, 0, 0]]
    sampler = store.sampler_params(store.step_slots[:3])
    assert sampler.temperature.tolist() == pytest.approx([0.0, 0.0, 0.7])
    assert sampler.top_k.tolist() == [0, 0, 40]
    assert sampler.seed.tolist() == [12, 0, 11]


def test_advance_and_loop_back_skip_padding_and_keep_the_sink_row_zero(store: SlotStore):
    store.write_runs(writes_of((1, 0, [4, 0, 0, 1]), (2, 0, [9, 0, 0, 2, 3])))
    store.set_slots(np.array([1, 0, 2, 0], dtype=np.int32))
    store.advance(4)
    store.advance(4)
    store.store_tokens(4, torch.tensor([31, 32, 33, 34], device=store.device))
    assert store.rows[:, KV_LEN].tolist() == [0, 6, 11, 0, 0, 0, 0, 0, 0]
    assert store.last_token.tolist() == [0, 31, 33, 0, 0, 0, 0, 0, 0]
    assert not store.rows[0].any()
    # A narrower bucket reads the first rows of the same slots.
    store.advance(1)
    assert store.rows[:, KV_LEN].tolist()[:3] == [0, 7, 11]
    store.store_prefill_tokens(
        torch.tensor([5, 7], device=store.device), torch.tensor([77, 78], device=store.device)
    )
    assert store.last_token[5].item() == 77 and store.last_token[7].item() == 78


def test_sampler_write_keeps_or_overwrites_the_loop_back_token(store: SlotStore):
    store.last_token[1:3] = torch.tensor([50, 60], device=store.device)
    store.write_sampler(
        np.array([1, 2], dtype=np.int32),
        np.array([[1.5, 0.5], [0.0, 1.0]], dtype=np.float32),
        # seed halves: lo = 0xFFFFFFFF (as int32: -1), hi = 1 -> 0x1_FFFF_FFFF; hi = -1 sets the top bit.
        np.array([[7, -1, 1, -1], [0, 5, -1, 70]], dtype=np.int32),
    )
    assert store.last_token[1:3].tolist() == [50, 70]
    assert store.seed[1].item() == 0x1_FFFF_FFFF
    assert store.seed[2].item() == (0xFFFF_FFFF_0000_0005 - (1 << 64))
    assert store.temperature[1:3].tolist() == [1.5, 0.0]
    assert store.top_p[1:3].tolist() == [0.5, 1.0]
    assert store.top_k[1:3].tolist() == [7, 0]


def test_mismatches_count_real_rows_only(store: SlotStore):
    row = [3, 0, 0, 1, 2, 0, 0]
    store.write_runs(writes_of((4, 0, row)))
    store.set_slots(np.array([4, 0], dtype=np.int32))
    mirror = np.array([row, [0] * C], dtype=np.int32)
    assert store.mismatches(2, mirror) == 0
    mirror[0, KV_LEN] = 4
    mirror[0, BLOCK_TABLE + 2] = 9
    mirror[1, POS_OFFSET] = 5  # a padding row: not counted
    assert store.mismatches(2, mirror) == 2


def test_back_to_back_writes_do_not_clobber_each_other(store: SlotStore):
    # Each write refills the same staging region; on CUDA it must wait for the previous upload.
    for step in range(40):
        store.write_runs(writes_of((1 + step % 8, 0, [step] * C)))
        store.write_runs(writes_of((1 + (step + 3) % 8, KV_LEN, [1000 + step])))
    rows = store.rows.cpu().numpy()
    for slot in range(1, 9):
        last_run = max(step for step in range(40) if 1 + step % 8 == slot)
        last_cell = max(step for step in range(40) if 1 + (step + 3) % 8 == slot)
        expected = [last_run] * C
        if last_cell > last_run:
            expected[KV_LEN] = 1000 + last_cell
        assert rows[slot].tolist() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_table_work_and_sampling_never_wait_for_the_gpu():
    from executor_svc.sampler import sample

    store = SlotStore(LAYOUT, torch.device("cuda"))
    torch.cuda.set_sync_debug_mode("error")  # any implicit device-to-host wait raises
    try:
        for _ in range(3):
            # A plan of new rows, applied as the runner does: slots, runs, sampler state and controls.
            store.apply(
                CheckedPlan(
                    4,
                    np.array([1, 0, 2, 0], dtype=np.int32),
                    writes_of((1, 0, [4, 0, 0, 1]), (2, 0, [9, 0, 0, 2, 3])),
                    np.array([1, 2], dtype=np.int32),
                    np.array([[0.8, 0.9], [0.0, 1.0]], np.float32),
                    np.array([[5, 1, 0, 7], [0, 2, 0, -1]], dtype=np.int32),
                    [],
                    [],
                    [],
                    None,
                )
            )
            store.write_runs(writes_of((1, BLOCK_TABLE + 1, [5])))
            inputs = store.gather(4)
            logits = torch.randn(4, 100, device="cuda")
            tokens = sample(logits, *store.sampler_params(store.step_slots[:4]), inputs.positions + 1)
            store.store_tokens(4, tokens)
            store.store_prefill_tokens(store.step_slots[:1], tokens[:1])
            store.advance(4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert store.rows[1:3, KV_LEN].tolist() == [5, 10]
