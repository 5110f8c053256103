"""The CPU side by side of issue 17: deltaserve (planner and executor as processes, as `deltaserve up` runs
them) against Hugging Face transformers `generate` and llama.cpp on the same GGUF, greedy, ignore-eos, the
same token ids, in interleaved rounds; and the executor's resident memory with packed vs de-quantized weights.

    python bench/serve_cpu.py --side-by-side [--llamacpp-python /work/llamacpp-venv-noamx/bin/python] [--rounds 2]

Each figure is output tokens / wall seconds of c copies of one prompt run together (prefill included), with
the load average beside it (the machine may be shared). llama.cpp runs in its own venv's python
(bench/llamacpp_worker.py); without --llamacpp-python its arm is left out.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from planner_svc.client import GenerateOptions, PlannerClient
from protos.model_files import default_model_path
from protos.progress import Progress

STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, and watched the ships "
    "pass the rocks below while the sea wind rattled the windows of the lantern room. "
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompt_ids(length: int) -> list[int]:
    from tests.hf_reference import hf_tokenizer

    ids = hf_tokenizer()(STORY * (1 + length // 20))["input_ids"]
    return list(ids[:length])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


class Deltaserve:
    """An executor and a planner process pair; `weights` is the executor's --weights, `decode_steps` the
    planner's --decode-steps (None: its default)."""

    def __init__(self, weights: str, threads: int, decode_steps: int | None = None) -> None:
        self.executor_port, self.planner_port = free_port(), free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DELTASERVE_LOG_LEVEL": "warning"}
        cli = [sys.executable, "-m", "deltaserve"]
        self.executor = subprocess.Popen(
            [*cli, "executor", "--port", str(self.executor_port), "--device", "cpu", "--weights", weights]
            + ["--pool-pages", "256", "--buckets", "1,2,4,8"],  # 4 x 576 tokens fit; 190 MB of KV
            env=env,
            cwd=ROOT,
        )
        self.planner = subprocess.Popen(
            [
                *cli,
                "planner",
                "--port",
                str(self.planner_port),
                "--executor",
                f"127.0.0.1:{self.executor_port}",
            ]
            + ["--no-prefix-cache"]  # every round reads its prompt, as the other arms do
            + ([] if decode_steps is None else ["--decode-steps", str(decode_steps)]),
            env=env,
            cwd=ROOT,
        )
        self.addr = f"127.0.0.1:{self.planner_port}"

    async def ready(self) -> None:
        async with PlannerClient(self.addr) as client:
            await client.wait_ready(timeout=600)
            await client.generate_all(GenerateOptions(token_ids=prompt_ids(28), max_tokens=4))  # warm-up

    async def run(self, prompt: list[int], concurrency: int, max_tokens: int) -> tuple[int, float]:
        options = GenerateOptions(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
        async with PlannerClient(self.addr) as client:
            began = time.perf_counter()
            results = await asyncio.gather(*(client.generate_all(options) for _ in range(concurrency)))
            return sum(len(r.token_ids) for r in results), time.perf_counter() - began

    def stop(self) -> None:
        for process in (self.planner, self.executor):
            process.terminate()
            process.wait(60)


class Transformers:
    """transformers `generate` in this process, on `threads` of torch's threads."""

    def __init__(self, threads: int) -> None:
        from tests.hf_reference import hf_model

        torch.set_num_threads(threads)
        self.model = hf_model()
        self.run([1, 2, 3, 4], 1, 2)  # warm-up

    def run(self, prompt: list[int], concurrency: int, max_tokens: int) -> tuple[int, float]:
        ids = torch.tensor([prompt] * concurrency)
        began = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=2,
            )
        return (out.shape[1] - len(prompt)) * concurrency, time.perf_counter() - began


class LlamaCpp:
    """bench/llamacpp_worker.py under another venv's python, over pipes."""

    def __init__(self, python: str, threads: int, max_seqs: int) -> None:
        worker = os.path.join(ROOT, "bench", "llamacpp_worker.py")
        # llama.cpp logs much to stderr: kept in a file, its tail quoted when the worker dies
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [python, worker, default_model_path(), str(threads), str(max_seqs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.version = self._answer()["version"]

    def _answer(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait(60)
            self.log.seek(0)
            tail = self.log.read()[-1500:]
            raise RuntimeError(
                f"the llama.cpp worker exited with code {code} (-11: a crash; an AMX build by GCC 12 crashes "
                f"so, see docs/BENCHMARKS.md); its stderr ends:\n{tail}"
            )
        return json.loads(line)

    def run(self, prompt: list[int], concurrency: int, max_tokens: int) -> tuple[int, float]:
        assert self.process.stdin is not None
        request = {"prompt": prompt, "concurrency": concurrency, "max_tokens": max_tokens}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        return answer["tokens"], answer["seconds"]

    def stop(self) -> None:
        self.process.terminate()
        self.log.close()


async def resident_memory(threads: int) -> dict[str, float]:
    """The executor process's RSS after load and one short request, packed and de-quantized."""
    sizes = {}
    for weights in ("packed", "dequantize"):
        serving = Deltaserve(weights, threads)
        try:
            await serving.ready()
            sizes[weights] = round(rss_mib(serving.executor.pid), 1)
        finally:
            serving.stop()
        print(f"executor RSS, weights {weights}: {sizes[weights]} MiB", flush=True)
    return sizes


async def side_by_side(args) -> list[dict]:
    from bench.common import commit_hash

    memory = await resident_memory(args.threads)
    cases = [(length, c) for length in (28, 512) for c in args.concurrency]
    prompts = {length: prompt_ids(length) for length, _ in cases}
    servings = [Deltaserve(args.weights, args.threads)]
    arms: dict = {"deltaserve": servings[0].run}
    if args.baseline_decode_steps:  # deltaserve again, its planner at that many decode steps a plan
        servings.append(Deltaserve(args.weights, args.threads, args.baseline_decode_steps))
        arms[f"deltaserve, {args.baseline_decode_steps} decode steps a plan"] = servings[1].run
    for serving in servings:
        await serving.ready()
    arms["transformers"] = Transformers(args.threads).run
    llama = None
    if args.llamacpp_python:
        llama = LlamaCpp(args.llamacpp_python, args.threads, max(args.concurrency))
        arms[f"llama.cpp {llama.version}"] = llama.run
    figures: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    try:
        with Progress("side by side", total=args.rounds * len(cases) * len(arms), unit="runs") as progress:
            for _ in range(args.rounds):
                for length, c in cases:
                    for arm, run in arms.items():
                        outcome = run(prompts[length], c, args.max_tokens)
                        if asyncio.iscoroutine(outcome):
                            outcome = await outcome
                        tokens, seconds = outcome
                        load = os.getloadavg()[0]
                        figures.setdefault((arm, length, c), []).append((tokens / seconds, load))
                        print(
                            f"  {arm} prompt {length} c={c}: {tokens / seconds:.1f} tok/s, load {load:.2f}",
                            flush=True,
                        )
                        progress.advance()
    finally:
        for serving in servings:
            serving.stop()
        if llama is not None:
            llama.stop()
    results, commit = [], commit_hash()
    for (arm, length, c), runs in figures.items():
        rates = [round(rate, 1) for rate, _ in runs]
        result = {
            "arm": arm,
            "prompt_tokens": length,
            "concurrency": c,
            "tok_s": round(statistics.mean(rates), 1),
            "rounds": rates,
            "load_avg_1m": [round(load, 2) for _, load in runs],
            "max_tokens": args.max_tokens,
            "weights": args.weights if arm.startswith("deltaserve") else "",
            "threads": args.threads,
            "commit": commit,
        }
        results.append(result)
        print(
            f"{arm:24s} prompt {length:4d} c={c}  {result['tok_s']:7.1f} tok/s  rounds {rates}  "
            f"load {result['load_avg_1m']}",
            flush=True,
        )
    results.append({"executor_rss_mib": memory, "commit": commit})
    return results
