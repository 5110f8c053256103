"""The rows of a decode step (planner_svc/decode_rows.py): stored lengths, the ready rows, their slot order."""

from __future__ import annotations

import numpy as np

from planner_svc.decode_rows import in_slot_order, ready_rows, repeats_left, stored_lengths
from planner_svc.requests import Request
from protos.layout import RowLayout


def request(name: str, prompt: int = 10, max_tokens: int = 5, **fields) -> Request:
    made = Request(name, [1] * prompt, max_tokens)
    for key, value in fields.items():
        setattr(made, key, value)
    return made


def test_stored_lengths_come_from_the_mirror_unless_the_row_is_stale_or_has_no_slot():
    rows = np.zeros((5, RowLayout.NARROW + 2), dtype=np.int32)
    rows[1:, RowLayout.KV_LEN] = [11, 12, 13, 14]
    fresh = request("fresh", stale=False, kv_len=99)
    stale = request("stale", stale=True, kv_len=7)
    slotless = request("slotless", stale=False, kv_len=8)
    lens = stored_lengths([fresh, stale, slotless, request("other", stale=False)], [3, 2, None, 4], rows)
    assert lens.dtype == np.int64 and lens.tolist() == [13, 7, 8, 14]


def test_ready_rows_are_those_below_their_end():
    done, running = request("done", 10, 5), request("running", 10, 5)  # end_len 14
    ready, ends, left = ready_rows([done, running], np.array([14, 12]), room=4)
    assert ready == [running] and ends.tolist() == [14] and not left


def test_too_many_ready_rows_leave_the_most_recently_run():
    rows = [request(f"r{i}", last_seq=seq) for i, seq in enumerate([5, 3, 5, 1])]
    ready, ends, left = ready_rows(rows, np.zeros(4, dtype=np.int64), room=3)
    assert [r.request_id for r in ready] == ["r3", "r1", "r0"] and left  # ties in candidate order
    assert ends.tolist() == [14, 14, 14]


def test_in_slot_order_sorts_rows_slots_and_ends_together():
    a, b, c = request("a"), request("b"), request("c")
    rows, slots, ends = in_slot_order([a, b, c], [7, 2, 4], np.array([70, 20, 40]))
    assert rows == [b, c, a] and slots.dtype == np.int32
    assert slots.tolist() == [2, 4, 7] and ends.tolist() == [20, 40, 70]


def test_repeats_left_is_the_nearest_end_of_the_real_rows():
    rows = np.zeros((5, RowLayout.NARROW + 2), dtype=np.int32)
    rows[1:, RowLayout.KV_LEN] = [10, 20, 30, 40]
    slots = np.array([3, 1, 0, 0], dtype=np.int32)  # two real rows, then padding (the sink, length 0)
    assert repeats_left(np.array([35, 12]), rows, slots) == 2
