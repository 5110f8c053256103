"""bench/step_timeline.py: the round's summary from joined step notes, and bench/decode.py --timeline in a CPU
smoke run (the planner's and the executor's notes of each step, in a child executor and in process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.step_timeline import in_ms, joined, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step(seq: int, chunks: int, launch: tuple[float, float], gpu: tuple[float, float]) -> dict:
    return {"seq": seq, "prefill_chunks": chunks, "launch": list(launch), "gpu": list(gpu)}


def test_the_summary_splits_the_gpus_gaps_at_the_last_prefill_and_times_the_wire() -> None:
    planner = [{"seq": s, "sent": 0.0, "received": 0.0105 + s * 0.01} for s in range(4)]
    executor = [
        step(0, 2, (0.000, 0.004), (0.001, 0.009)),  # a prefill launch of 4 ms
        step(1, 0, (0.004, 0.005), (0.010, 0.012)),  # 1 ms idle before it
        step(2, 1, (0.012, 0.013), (0.012, 0.020)),  # back to back: the last prefill ends at 20 ms
        step(3, 0, (0.020, 0.021), (0.023, 0.025)),  # 3 ms idle, after the prefill
    ]
    for s, record in enumerate(executor):
        record["collected"] = 0.010 + s * 0.01
    figures = summary(joined(planner, executor), requests=(-0.002, 0.0435))
    assert figures["prefill_steps"] == 2 and figures["prefill_launch_ms"] == [4.0, 1.0]
    # the clients sent 2 ms before the first plan and got their last token 3 ms after the last output came
    assert figures["clients_ms"] == {"before_first_plan": 2.0, "after_last_output": 3.0}
    assert figures["prefill_done_ms"] == 19.0
    assert figures["gpu_gap_ms"] == {"until_prefill_done": 1.0, "after": 3.0}
    assert figures["output_to_commit_ms"] == {"p50": 0.5, "max": 0.5}


def test_steps_noted_by_one_side_only_still_join_and_times_count_from_the_first() -> None:
    steps = joined(
        [{"seq": 2, "sent": 5.0}], [{"seq": 1, "launch": [5.5, 6.0]}, {"seq": 2, "collected": 7.0}]
    )
    assert [s["seq"] for s in steps] == [1, 2]
    assert in_ms(steps) == [
        {"seq": 1, "launch": [500.0, 1000.0]},
        {"seq": 2, "sent": 0.0, "collected": 2000.0},
    ]
    assert summary(steps) == {"prefill_steps": 0, "prefill_launch_ms": [], "output_to_commit_ms": None}


def test_decode_writes_each_rounds_steps_with_timeline_on_the_cpu(tmp_path) -> None:
    timeline = tmp_path / "timeline.json"
    command = [
        sys.executable,
        os.path.join(ROOT, "bench", "decode.py"),
        *("--device", "cpu", "--arms", "resident,resident-inprocess", "--concurrency", "2", "--rounds", "1"),
        *("--prompt-tokens", "16", "--output-tokens", "4", "--timeline", str(timeline)),
        *("--out", str(tmp_path / "decode.json"), "--plot", str(tmp_path / "p.png")),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = json.loads(timeline.read_text())
    assert sorted(r["arm"] for r in rounds) == ["resident", "resident-inprocess"]
    for record in rounds:
        assert record["steps"], record
        for noted in record["steps"]:  # both sides noted every step of the round
            assert {"sent", "received", "launch", "collected"} <= noted.keys(), noted
    figures = [r for r in json.loads((tmp_path / "decode.json").read_text()) if "rounds" in r]
    assert all(r["rounds"][0]["timeline"]["prefill_steps"] >= 1 for r in figures), figures
    assert all(r["rounds"][0]["timeline"]["clients_ms"]["before_first_plan"] >= 0 for r in figures), figures
