"""Device time of the sampling tail of a decode step, each variant captured in a CUDA graph (issue 15).

    python bench/sampling_tails.py [--rows 16,64,256] [--out docs/bench/sampling_tails.json] [--commit SHA]

SmolLM2's vocabulary (49,152), every row with controls on (penalties, bias, min-p; logprobs): the sampled
tail (`sample`), and the controlled one's parts in their torch form (the CPU's) and their Triton kernels
(CUDA's): the logit adjustment, the input counts, the logprob table, and the whole controlled tail. Each
figure: the mean over 200 replays of its graph.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from bench.common import captured_us, commit_hash, write_json
from executor_svc.control_writes import TOP_LOGPROBS
from executor_svc.kernels.controls import fused_logprob_table
from executor_svc.sampler import sample
from executor_svc.sampler_controls import SamplerControls, logprob_table, sample_controlled

VOCAB, REPLAYS = 49152, 200


def graph_us(step: Callable[[], object]) -> float:
    """Mean device µs of one replay of `step` captured in a CUDA graph (warmed on a side stream first)."""
    return round(captured_us(step, REPLAYS, warmups=3), 1)


def tails(rows: int) -> dict[str, Callable[[], object]]:
    device = torch.device("cuda")
    controls = SamplerControls(rows + 1, VOCAB, device)  # slot 0: the sink
    controls.on[1:] = True
    controls.repetition[:], controls.frequency[:], controls.presence[:], controls.min_p[:] = (
        1.1,
        0.2,
        0.2,
        0.02,
    )
    controls.counts[:, :50], controls.seen[:, :80] = 1, True
    logits = torch.randn(rows, VOCAB, device=device) * 3  # logits: [B, V]
    slots = torch.arange(1, rows + 1, device=device)
    params = (
        torch.full((rows,), 0.8, device=device),
        torch.ones(rows, device=device),
        torch.zeros(rows, dtype=torch.int64, device=device),
        torch.arange(rows, device=device),
    )
    counter = torch.arange(rows, device=device)
    tokens = torch.zeros(rows, dtype=torch.int64, device=device)

    def on(fused: bool, step: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            controls.fused = fused
            return step()

        return run

    return {
        "sampled": lambda: sample(logits, *params, counter),
        "adjust_torch": on(False, lambda: controls.apply(logits, slots)),
        "adjust_triton": on(True, lambda: controls.apply(logits, slots)),
        "count_inputs_torch": on(False, lambda: controls.count_inputs(slots, tokens)),
        "count_inputs_triton": on(True, lambda: controls.count_inputs(slots, tokens)),
        "logprob_table_torch": lambda: logprob_table(logits, tokens),
        "logprob_table_triton": lambda: fused_logprob_table(logits, tokens, TOP_LOGPROBS),
        "controlled_torch": on(False, lambda: sample_controlled(logits, params, controls, slots, counter)),
        "controlled_triton": on(True, lambda: sample_controlled(logits, params, controls, slots, counter)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="16,64,256")
    parser.add_argument("--out", default="docs/bench/sampling_tails.json")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/sampling_tails.py needs a CUDA device")
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, step in tails(rows).items():
            record = dict(rows=rows, tail=name, device_us=graph_us(step), commit=args.commit or commit_hash())
            print(record, flush=True)
            records.append(record)
    write_json(args.out, records)


if __name__ == "__main__":
    main()
