"""bench/chain.py's analysis: segments of the chain from step N's tokens to the launch of step N+2."""

from __future__ import annotations

from bench.chain import SEGMENTS, chains


def test_chain_segments_add_up_from_the_stamps():
    # Steps 0..3 of bucket 1, stamps in µs (as ns): executor ("x") and planner link marks.
    executor, planner = {}, {}
    for seq in range(4):
        t = 1000 * seq  # one step a millisecond
        executor[seq] = {
            "read": t + 10,
            "launch0": t + 12,
            "launch1": t + 20,
            "bucket1": 0,
            "done": t + 700,
            "yield": t + 740,
        }
        planner[seq] = {"send0": t, "send1": t + 5, "recv": t + 800}
    executor = {s: {k: v * 1000 for k, v in m.items()} for s, m in executor.items()}
    planner = {s: {k: v * 1000 for k, v in m.items()} for s, m in planner.items()}
    per_bucket = chains(executor, planner)
    # N = 0 and 1 have a step N+2 (2, 3) with every mark.
    segments = per_bucket[1]
    assert set(segments) == set(SEGMENTS) and len(segments["chain"]) == 2
    assert segments["exec_out"] == [40.0, 40.0]  # done -> yield
    assert segments["grpc_out"] == [60.0, 60.0]  # yield -> recv
    assert segments["planner"] == [1200.0, 1200.0]  # recv of N (800) -> send0 of N+2 (2000)
    assert segments["grpc_in"] == [10.0, 10.0] and segments["to_launch"] == [2.0, 2.0]
    assert segments["launch"] == [8.0, 8.0]
    assert segments["chain"] == [1320.0, 1320.0]  # done of N (700) -> launch1 of N+2 (2020)
    assert segments["period"] == [1000.0, 1000.0]


def test_batches_begin_where_the_executor_idled_and_the_timeline_sums_them_by_kind():
    from bench.chain import runs, timeline

    # (start, done, prompt tokens, bucket) in ms: batch one reads prompts in steps 0, 1 and 3 (a late arrival
    # after a decode-only step), then decodes; the executor idles 5 ms; batch two reads its prompt and decodes.
    steps = [
        (0, 10, 2048, 2),
        (9, 20, 2048, 4),
        (19, 22, 0, 4),
        (21, 33, 512, 4),
        (32, 35, 0, 4),
        (34, 37, 0, 4),
    ]
    steps += [(42, 50, 1024, 1), (49, 52, 0, 1), (51, 54, 0, 1)]
    executor = {}
    for seq, (start, done, tokens, bucket) in enumerate(steps):
        marks = {"read": start, "launch0": start, "launch1": start + 0.1, f"bucket{bucket}": 0, "done": done}
        if tokens:
            marks[f"prefill{tokens}"] = 0
        executor[seq] = {name: int(ms * 1e6) for name, ms in marks.items()}
    assert runs(executor) == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    row = timeline("resident", executor, [0, 1, 2, 3, 4, 5])
    assert row["first_step_ms"] == 10.0 and row["wall_ms"] == 37.0 and row["widest_bucket"] == 4
    assert (row["prefill_steps"], row["prefill_ms_sum"], row["prompt_tokens"]) == (2, 21.0, 2560)
    assert (row["decode_steps"], row["decode_ms_sum"]) == (3, 6.0)
