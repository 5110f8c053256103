"""Issue 15's sampling controls over real gRPC on SmolLM2: stop strings matched across token boundaries."""

from __future__ import annotations

import pytest

from planner_svc.client import GenerateOptions, PlannerClient

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "The capital of France is Paris. The capital of Germany is"


async def free_state(stack, client: PlannerClient) -> tuple[int, int]:
    await stack.wait_idle()
    info = await client.server_info()
    return info.free_pages + sum(c.pages for c in await client.conversations()), info.free_slots


async def test_a_stop_string_split_across_tokens_ends_the_choice_before_it(smol_stack):
    tokenizer = smol_stack.planner.tokenizer
    async with PlannerClient(smol_stack.addr) as client:
        before = await free_state(smol_stack, client)
        plain = await client.generate_all(GenerateOptions(text=PROMPT, max_tokens=16, ignore_eos=True))
        # A stop string made of the end of token 3's text and the start of token 4's: split across them.
        pieces = [tokenizer.decode(plain.token_ids[: i + 1]) for i in range(len(plain.token_ids))]
        assert pieces[-1] == plain.text
        cut = len(pieces[2])
        stop = plain.text[cut - 2 : cut + 2]
        assert len(stop) == 4 and pieces[3][cut - 2 :].startswith(stop[:2]), (stop, pieces[:5])
        at = plain.text.index(stop)
        stopped = await client.generate_all(
            GenerateOptions(text=PROMPT, max_tokens=16, ignore_eos=True, stop=["never here", stop])
        )
        assert (stopped.finish_reason, stopped.stop_string) == ("stop", stop)
        assert stopped.text == plain.text[:at]
        # The tokens end with the one that completed the match; the request ended there, its pages free.
        ends = next(i for i, piece in enumerate(pieces) if len(piece) >= at + len(stop))
        assert stopped.token_ids == plain.token_ids[: ends + 1]
        assert await free_state(smol_stack, client) == before
        unmatched = await client.generate_all(
            GenerateOptions(text=PROMPT, max_tokens=16, ignore_eos=True, stop=["never here"])
        )
        assert (unmatched.text, unmatched.finish_reason, unmatched.stop_string) == (plain.text, "length", "")
