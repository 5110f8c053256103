"""GPU decode benchmark (issue 3): resident vs host-planned over gRPC, and resident through an in-process link.

    python bench/decode.py [--tokenizer DIR] [--concurrency 1,16,64,256] [--rounds 2]
                           [--out docs/bench/decode.json] [--plot docs/decode.png]
    python bench/decode.py --compile-only   # build FlashInfer's decode kernel (JIT) and exit
    python bench/decode.py --model-shape qwen3.5-0.8b --out docs/bench/decode_qwen3_5.json \
                           --plot docs/decode_qwen3_5.png   # the Qwen3.5 hybrid's shape

SmolLM2-135M's shape (or --model-shape's) with random bf16 weights (no checkpoint needed), random 512-token
prompts (ids below SmolLM2's vocabulary, which the default tokenizer decodes), 256 output
tokens each (EOS ignored), prefix cache off. Arms alternate within each round. Prints one line per
measurement; writes one JSON object per arm and concurrency (both rounds inside) and a plot of tok/s.

Processes as deployed: the gRPC arms run their executor in a child process of its own (this script with
--serve-executor), and the clients (the load generator) run in another child process (--serve-clients); the
planners and the in-process arm's executor share this process. Each record's "executor_process" ("child" or
"same") says where its executor ran, and its "clients_process" ("child") where its clients did.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deltaserve.aio
from bench.common import write_json
from bench.decode_arms import ARMS, DEFAULT_ARMS, arm_list, in_process
from bench.decode_model import MODEL_SHAPES, compile_only
from bench.decode_report import plot
from bench.decode_run import run
from bench.decode_serve import serve_clients, serve_executor
from executor_svc.config import DEFAULT_PREFILL_BUCKETS


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir or GGUF (default: the SmolLM2 GGUF)")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument(
        "--model-shape",
        choices=MODEL_SHAPES,
        default=MODEL_SHAPES[0],
        help="the model whose shape random bf16 weights fill (qwen3.5-0.8b: the hybrid, its state pool by slot)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--arms",
        type=arm_list,
        default=DEFAULT_ARMS,
        help=f"comma-separated, of {','.join(ARMS)} (default: {','.join(DEFAULT_ARMS)}); resident-auth and "
        "resident-tls are the resident gRPC arm with an API key, or TLS, on the client API (and TLS on the "
        "planner's link to the executor): their cost against resident",
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument(
        "--prefill-token-budget", type=int, default=None, help="prompt tokens a step (default: the planner's)"
    )
    parser.add_argument(
        "--prefill-buckets",
        default=",".join(map(str, DEFAULT_PREFILL_BUCKETS)),
        help="prefill graphs' token buckets (default: the executor's)",
    )
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--out", default="docs/bench/decode.json")
    parser.add_argument("--plot", default="docs/decode.png")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument(
        "--timeline",
        help="write each round's steps (bench/step_timeline.py) to this JSON file, and a summary per round",
    )
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the harness (eager, no graphs)")
    # The executor child's mode (ExecutorChild starts it): the arm, its pool and its buckets.
    child_arms = [arm for arm in ARMS if not in_process(arm)]
    parser.add_argument("--serve-executor", choices=child_arms, help=argparse.SUPPRESS)
    parser.add_argument("--pool-pages", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--buckets", help=argparse.SUPPRESS)
    parser.add_argument("--tls-cert", help=argparse.SUPPRESS)  # the TLS arm's executor child
    parser.add_argument("--tls-key", help=argparse.SUPPRESS)
    parser.add_argument("--serve-clients", action="store_true", help=argparse.SUPPRESS)  # ClientsChild's mode
    parser.add_argument(
        "--serve-timeline", action="store_true", help=argparse.SUPPRESS
    )  # its executor's notes
    args = parser.parse_args()
    if args.serve_clients:  # the load generator needs no device
        deltaserve.aio.run(serve_clients)
        return
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("bench/decode.py needs a CUDA device (or --device cpu for a smoke run)")
    if args.compile_only:
        compile_only(args.model_shape)
        return
    if args.serve_executor:
        deltaserve.aio.run(lambda stop: serve_executor(args, stop))
        return
    records = deltaserve.aio.run(lambda stop: run(args))
    write_json(args.out, records)
    plot(records, args.plot)


if __name__ == "__main__":
    main()
