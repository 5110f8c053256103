"""scripts/compose_e2e.py's client calls on a stack: generate, a multi-turn conversation, park, and the
reference tokens from `deltaserve up` outside docker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from scripts.compose_e2e_util import REPO, Timer, free_port, log, run

PROMPT = "Name three colors of the rainbow."
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
MAX_TOKENS = 12


def chat_of(turns: list[str], replies: list[str]) -> list[dict]:
    chat = []
    for i, turn in enumerate(turns):
        chat.append({"role": "user", "content": turn})
        if i < len(replies):
            chat.append({"role": "assistant", "content": replies[i]})
    return chat


def generate(addr: str, chat: list[dict], conversation: str | None = None) -> dict:
    flags = ["--conversation", conversation] if conversation else []
    out = subprocess.run(
        [sys.executable, "-m", "deltaserve", "--log-level", "warning", "generate", "--addr", addr]
        + ["--chat-json", "-", "--max-tokens", str(MAX_TOKENS), "--json", *flags],
        input=json.dumps(chat),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    if out.returncode != 0:
        raise RuntimeError(f"generate at {addr} exited {out.returncode}: {out.stderr}")
    return json.loads(out.stdout)


def conversation(addr: str, conversation_id: str, turns: int) -> list[dict]:
    """The first `turns` turns of TURNS, each prompt carrying the history with the replies generated."""
    results: list[dict] = []
    for n in range(1, turns + 1):
        results.append(generate(addr, chat_of(TURNS[:n], [r["text"] for r in results]), conversation_id))
    return results


def reference(work: Path, timer: Timer) -> tuple[dict, list[dict]]:
    """The same requests served by `deltaserve up` outside docker: one prompt, and a never-parked conversation."""
    port = free_port()
    up_log = open(work / "deltaserve-up.log", "w")
    up = subprocess.Popen(
        [sys.executable, "-m", "deltaserve", "up", "--device", "cpu", "--port", str(port), "--no-cache"],
        stdout=up_log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    addr = f"127.0.0.1:{port}"
    try:
        with timer("reference: `deltaserve up` outside docker, the prompt and 3 turns"):
            for _ in range(600):
                if up.poll() is not None:
                    raise RuntimeError(
                        f"deltaserve up exited {up.returncode}; see {work / 'deltaserve-up.log'}"
                    )
                probe = subprocess.run(
                    [sys.executable, "-m", "deltaserve.health_probe", addr], capture_output=True, cwd=REPO
                )
                if probe.returncode == 0:
                    break
                time.sleep(1)
            one = generate(addr, [{"role": "user", "content": PROMPT}])
            turns = conversation(addr, "never-parked", len(TURNS))
    finally:
        up.terminate()
        up.wait(60)
        up_log.close()
    log(f"reference tokens {one['token_ids']}; turn 3 {turns[-1]['token_ids']}")
    return one, turns


def park(addr: str, conversation_id: str) -> dict:
    out = run(
        sys.executable,
        "-m",
        "deltaserve",
        "--log-level",
        "warning",
        "park",
        conversation_id,
        "--addr",
        addr,
        "--json",
    )
    return json.loads(out)
