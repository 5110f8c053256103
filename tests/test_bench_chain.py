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
