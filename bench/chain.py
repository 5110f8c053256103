"""Where a decode step's time goes between the GPU and the host: the chain from step N's tokens being back to
the launch of step N+2 (the plan that had to wait for them), by segment, from per-step timestamps.

    python bench/chain.py [--tokenizer DIR] [--concurrency 1,64] [--arms resident,resident-inprocess]
                          [--rounds 1] [--device cuda] [--out docs/bench/chain.json]

Runs bench/decode.py with bench/chain_trace/ first on its processes' PYTHONPATH (its sitecustomize stamps the
step path; at most one gRPC arm per run, so the planner's link stamps are that arm's), then prints the median
and mean of each segment per arm and bucket, µs:

    exec_out   tokens back -> output handed to the stream (executor)
    grpc_out   -> output received by the planner
    planner    -> plan N+2 sent (commit, plan, encode)
    grpc_in    -> plan N+2 read by the executor
    to_launch  -> its launch begins
    launch     the launch call
    chain      tokens of N back -> N+2 launched: the GPU stays busy while this is shorter than a step
    period     tokens of N back -> tokens of N+1 back

and, per arm, the run's timeline by kind of step: the periods (tokens of N-1 back -> tokens of N back) of the
steps that read prompt tokens and of those that only decode, summed, with the launch call's host time of each
kind: where a run's wall time goes between prompts and decoding; and how the batch began: its requests' arrivals
at the planner and its first steps (read, tokens back, prompt tokens, bucket), in ms from the first arrival.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import commit_hash, write_json  # noqa: E402
from bench.decode_arms import arm_list, in_process  # noqa: E402

SEGMENTS = ("exec_out", "grpc_out", "planner", "grpc_in", "to_launch", "launch", "chain", "period")
BATCH_IDLE_MS = 1.0  # the executor idle this long before a step that reads prompts: a new batch of requests
HEAD_STEPS = 8  # a batch's first steps shown one by one
MIN_SAMPLES = 20  # buckets with fewer chains (warm-up, ramps), and batches with fewer steps, are not reported


def by_seq(records: list, tag: str) -> dict[int, dict[str, int]]:
    marks: dict[int, dict[str, int]] = {}
    for record_tag, seq, name, ns in records:
        if record_tag == tag:
            marks.setdefault(seq, {})[name] = ns
    return marks


def chains(
    executor: dict[int, dict[str, int]], planner: dict[int, dict[str, int]]
) -> dict[int, dict[str, list]]:
    """Per bucket of step N+2: each segment's durations (µs) over the steps N with every mark present."""
    out: dict[int, dict[str, list]] = {}
    for seq, step in executor.items():
        later, next_step, sent, resent = (
            executor.get(seq + 2),
            executor.get(seq + 1),
            planner.get(seq),
            planner.get(seq + 2),
        )
        if not (later and next_step and sent and resent) or "done" not in step or "done" not in next_step:
            continue
        bucket = next((int(name[6:]) for name in later if name.startswith("bucket")), None)
        if bucket is None or "recv" not in sent or "send0" not in resent or "launch1" not in later:
            continue
        handed = step.get("yield", sent["recv"])  # in-process: the output is the received one
        read = later.get("read", resent["send0"])  # in-process: the plan is launched as it is sent
        values = (
            handed - step["done"],
            sent["recv"] - handed,
            resent["send0"] - sent["recv"],
            read - resent["send0"],
            later["launch0"] - read,
            later["launch1"] - later["launch0"],
            later["launch1"] - step["done"],
            next_step["done"] - step["done"],
        )
        segments = out.setdefault(bucket, {name: [] for name in SEGMENTS})
        for name, ns in zip(SEGMENTS, values, strict=True):
            segments[name].append(ns / 1000)
    return out


def runs(executor: dict[int, dict[str, int]]) -> list[list[int]]:
    """The steps (seqs) of each batch of requests the run sent, in order: decode.py sends a batch once the last
    has ended, so a step reading prompt tokens whose plan came after the executor had been idle for BATCH_IDLE_MS
    begins another batch (its warm-ups and rounds, each concurrency in turn). Within a batch the next plan is
    there before a step ends (two in flight), prompts arriving late included."""
    seqs = sorted(seq for seq, marks in executor.items() if "done" in marks and "launch0" in marks)
    out: list[list[int]] = []
    for before, seq in zip([None, *seqs], seqs):
        marks = executor[seq]
        start = marks.get("read", marks["launch0"])  # in-process: the plan is launched as it is sent
        idle_ms = float("inf") if before is None else (start - executor[before]["done"]) / 1e6
        if idle_ms > BATCH_IDLE_MS and any(name.startswith("prefill") for name in marks):
            out.append([])
        if out:
            out[-1].append(seq)
    return out


def prompt_tokens(marks: dict[str, int]) -> int:
    return next((int(name[7:]) for name in marks if name.startswith("prefill")), 0)


def beginning(executor: dict[int, dict[str, int]], seqs: list[int], submits: list[int], since: int) -> dict:
    """How a batch began: its requests' arrivals at the planner (those after `since`, the batch before's end)
    and its first steps, in ms from the first arrival."""
    arrived = sorted(ns for ns in submits if since < ns <= executor[seqs[-1]]["done"])
    if not arrived:
        return {}

    def ms(ns: int) -> float:
        return round((ns - arrived[0]) / 1e6, 2)

    head = []
    for seq in seqs[:HEAD_STEPS]:
        marks = executor[seq]
        bucket = next((int(name[6:]) for name in marks if name.startswith("bucket")), 0)
        read = marks.get("read", marks["launch0"])
        head.append([ms(read), ms(marks["done"]), prompt_tokens(marks), bucket])
    return {
        "arrivals": len(arrived),
        "arrivals_ms": [ms(arrived[len(arrived) // 2]), ms(arrived[-1])],  # median, last
        "head_steps": head,  # [read ms, tokens back ms, prompt tokens, bucket]
    }


def timeline(arm: str, executor: dict[int, dict[str, int]], seqs: list[int]) -> dict:
    """One batch's steps by kind (reading prompt tokens or only decoding): count, periods summed and median
    (ms), the launch call's host time (µs, median), prompt tokens; and the time to the first step's tokens."""
    kinds: dict[str, dict[str, list]] = {"prefill": {}, "decode": {}}
    for before, seq in zip(seqs, seqs[1:]):
        marks = executor[seq]
        tokens = prompt_tokens(marks)
        kind = kinds["prefill" if tokens else "decode"]
        kind.setdefault("period", []).append((marks["done"] - executor[before]["done"]) / 1e6)
        kind.setdefault("launch", []).append((marks["launch1"] - marks["launch0"]) / 1e3)
        kind.setdefault("tokens", []).append(tokens)
    first = executor[seqs[0]]
    start = first.get("read", first["launch0"])
    row: dict = {
        "arm": arm,
        "timeline": True,
        "first_step_ms": round((first["done"] - start) / 1e6, 2),
        "wall_ms": round((executor[seqs[-1]]["done"] - start) / 1e6, 1),
    }
    for name, kind in kinds.items():
        periods = kind.get("period", [])
        row[f"{name}_steps"] = len(periods)
        row[f"{name}_ms_sum"] = round(sum(periods), 1)
        row[f"{name}_ms_median"] = round(statistics.median(periods), 3) if periods else None
        row[f"{name}_launch_us_median"] = round(statistics.median(kind["launch"]), 1) if periods else None
    row["prompt_tokens"] = sum(kinds["prefill"].get("tokens", []))
    # the widest decode bucket the batch ran: its concurrency, rounded up to a bucket
    row["widest_bucket"] = max(
        (int(name[6:]) for seq in seqs for name in executor[seq] if name.startswith("bucket")), default=0
    )
    return row


def summarize(arm: str, per_bucket: dict[int, dict[str, list]]) -> list[dict]:
    rows = []
    for bucket, segments in sorted(per_bucket.items()):
        if len(segments["chain"]) < MIN_SAMPLES:
            continue
        row = {"arm": arm, "bucket": bucket, "steps": len(segments["chain"])}
        for name, values in segments.items():
            row[f"{name}_us_median"] = round(statistics.median(values), 1)
            row[f"{name}_us_mean"] = round(statistics.fmean(values), 1)
        rows.append(row)
    return rows


def analyse(trace_dir: str, grpc_arm: str | None, inprocess_arm: str | None) -> list[dict]:
    traces = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(trace_dir, "trace-*.json")))]
    rows = []
    executor = next((t for t in traces if any(name == "read" for _, _, name, _ in t)), None)
    planner = next((t for t in traces if any(tag == "g" for tag, _, _, _ in t)), None)
    if grpc_arm and executor and planner:
        rows += summarize(grpc_arm, chains(by_seq(executor, "x"), by_seq(planner, "g")))
        marks = by_seq(executor, "x")
        submits = [ns for tag, _, _, ns in planner if tag == "s"]
        since = 0
        for seqs in runs(marks):
            if len(seqs) >= MIN_SAMPLES:
                rows.append(timeline(grpc_arm, marks, seqs) | beginning(marks, seqs, submits, since))
            since = marks[seqs[-1]]["done"]
    local = next((t for t in traces if any(tag == "i" for tag, _, _, _ in t)), None)
    if inprocess_arm and local:
        rows += summarize(inprocess_arm, chains(by_seq(local, "x"), by_seq(local, "i")))
        marks = by_seq(local, "x")
        rows += [timeline(inprocess_arm, marks, seqs) for seqs in runs(marks) if len(seqs) >= MIN_SAMPLES]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--arms", type=arm_list, default=("resident", "resident-inprocess"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-shape", default=None, help="as bench/decode.py's (default: SmolLM2's)")
    parser.add_argument(
        "--decode-args", default="", help="more of bench/decode.py's arguments, as one string"
    )
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument("--out", default="docs/bench/chain.json")
    args = parser.parse_args()
    grpc_arms = [arm for arm in args.arms if not in_process(arm)]
    if len(grpc_arms) > 1:
        parser.error(
            f"at most one gRPC arm a run (the planner's link stamps would mix): got {', '.join(grpc_arms)}"
        )
    with tempfile.TemporaryDirectory() as scratch:
        trace_dir = os.path.join(scratch, "trace")
        env = dict(os.environ, DELTASERVE_CHAIN_TRACE=trace_dir)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(REPO, "bench", "chain_trace"), REPO, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        command = [
            sys.executable,
            os.path.join(REPO, "bench", "decode.py"),
            "--arms",
            ",".join(args.arms),
            "--concurrency",
            args.concurrency,
            "--rounds",
            str(args.rounds),
            "--device",
            args.device,
            "--out",
            os.path.join(scratch, "decode.json"),
            "--plot",
            os.path.join(scratch, "decode.png"),
            *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
            *(["--model-shape", args.model_shape] if args.model_shape else []),
            *args.decode_args.split(),
        ]
        subprocess.run(command, env=env, check=True)
        inprocess_arms = [arm for arm in args.arms if in_process(arm)]
        rows = analyse(
            trace_dir, grpc_arms[0] if grpc_arms else None, inprocess_arms[0] if inprocess_arms else None
        )
    commit = args.commit or commit_hash()
    for row in rows:
        row["commit"] = commit
        if row.get("timeline"):
            print(json.dumps(row), flush=True)
            continue
        print(
            f"{row['arm']:19s} bucket {row['bucket']:4d} ({row['steps']} steps)  "
            + "  ".join(
                f"{name} {row[f'{name}_us_median']:.0f}/{row[f'{name}_us_mean']:.0f}" for name in SEGMENTS
            ),
            flush=True,
        )
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
