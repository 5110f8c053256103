"""The row-check soaks' load (tests/test_e2e_row_check_soak.py on the CPU, bench/gpu_row_check.py on a GPU):
random requests, some abandoned by their client, and a count of the rows the slot cache displaces."""

from __future__ import annotations

import asyncio
import random
from typing import TypedDict

from planner_svc.client import GenerateOptions


class SoakRequest(TypedDict):
    """The GenerateOptions fields of one soak request (callers resend them, e.g. with another request_id)."""

    token_ids: list[int]
    max_tokens: int
    request_id: str
    temperature: float
    seed: int
    top_k: int
    top_p: float
    stop_token_ids: list[int]
    ignore_eos: bool


async def one_request(
    client, rng: random.Random, i: int, vocab_size: int, longest: int = 30, tokens_up_to: int = 25
) -> tuple[SoakRequest, list[int], bool]:
    """A random request (prompt of up to `longest` ids, up to `tokens_up_to` tokens, greedy or seeded) sent after a
    random pause; 15% are abandoned by the client after a few tokens. Returns (fields, tokens, finished)."""
    prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, longest))]
    greedy = rng.random() < 0.5
    fields = SoakRequest(
        token_ids=prompt,
        max_tokens=rng.randrange(1, tokens_up_to),
        request_id=f"soak-{i}",
        temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.5]),
        seed=rng.randrange(1 << 40),
        top_k=rng.choice([0, 5]),
        top_p=rng.choice([1.0, 0.9]),
        stop_token_ids=[rng.randrange(3, vocab_size)],
        ignore_eos=True,
    )
    await asyncio.sleep(rng.random() * 0.5)  # staggered arrivals
    abort_after = rng.randrange(1, 6) if rng.random() < 0.15 else None
    tokens: list[int] = []
    async for response in client.generate(GenerateOptions(**fields)):
        tokens.extend(
            int.from_bytes(response.token_ids[j : j + 4], "little")
            for j in range(0, len(response.token_ids), 4)
        )
        if abort_after is not None and len(tokens) >= abort_after:
            break  # the client goes away
    return fields, tokens, abort_after is None


class DisplacedCounter:
    """Counts the rows a slot cache displaces, from the assignments its `assign` returns."""

    def __init__(self, slots) -> None:
        self.count = 0
        assign = slots.assign

        def counting(seq, ids):
            assignment = assign(seq, ids)
            self.count += len(assignment.displaced)
            return assignment

        slots.assign = counting
