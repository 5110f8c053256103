"""Issue 15's sampling controls over real gRPC on SmolLM2: stop strings matched across token boundaries;
penalties and logit bias against a torch reference on transformers' logits; logprobs; min_tokens; seeds;
n = 2; structured output (json_schema validated with jsonschema, json_object)."""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest
import torch

from planner_svc.client import GenerateOptions, PlannerClient
from planner_svc.requests import Request
from protos import executor_pb2, executor_pb2_grpc
from tests.hf_reference import hf_model, hf_tokenizer

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


def hf_logits(ids: list[int]) -> torch.Tensor:
    """The model's next-token logits after `ids`, in transformers (the reference of every model path)."""
    with torch.inference_mode():
        return hf_model()(torch.tensor([ids])).logits[0, -1].float()


def penalized(
    logits: torch.Tensor, prompt: list[int], output: list[int], bias: dict[int, float]
) -> torch.Tensor:
    """The same rules in plain torch (vLLM's repetition penalty, OpenAI's frequency/presence and logit bias)."""
    logits = logits.clone()
    for token, value in bias.items():
        logits[token] += value
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / REP if logits[token] > 0 else logits[token] * REP
    for token in set(output):
        logits[token] -= FREQ * output.count(token) + PRES
    return logits


REP, FREQ, PRES = 1.3, 0.8, 0.4


async def test_penalties_and_logit_bias_follow_the_torch_reference(smol_stack):
    prompt = hf_tokenizer()("Repeat after me: apple apple apple apple")["input_ids"]
    banned = int(hf_logits(prompt).argmax())
    bias = {banned: -100.0, 11: 3.0}
    async with PlannerClient(smol_stack.addr) as client:
        got = await client.generate_all(
            GenerateOptions(
                token_ids=prompt,
                max_tokens=6,
                ignore_eos=True,
                repetition_penalty=REP,
                frequency_penalty=FREQ,
                presence_penalty=PRES,
                logit_bias=bias,
            )
        )
    expected: list[int] = []
    for _ in range(6):
        expected.append(int(penalized(hf_logits(prompt + expected), prompt, expected, bias).argmax()))
    assert got.token_ids == expected and banned not in got.token_ids


async def test_logprobs_are_log_softmax_of_the_model_logits(smol_stack):
    prompt = hf_tokenizer()(PROMPT)["input_ids"]
    async with PlannerClient(smol_stack.addr) as client:
        got = await client.generate_all(
            GenerateOptions(token_ids=prompt, max_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=3)
        )
        plain = await client.generate_all(GenerateOptions(token_ids=prompt, max_tokens=2, ignore_eos=True))
    assert got.token_ids == plain.token_ids and len(got.logprobs) == 2
    for index, entry in enumerate(got.logprobs):
        expected = torch.log_softmax(hf_logits(prompt + got.token_ids[:index]), dim=-1)
        top = expected.topk(3)
        assert entry.chosen.token_id == got.token_ids[index] == int(top.indices[0])
        assert entry.chosen.logprob == pytest.approx(float(top.values[0]), abs=1e-3)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(top.values.tolist(), abs=1e-3)
        assert entry.chosen.token == hf_tokenizer().decode([entry.chosen.token_id])
        assert entry.chosen.token_bytes.decode("utf-8", "replace") == entry.chosen.token


async def test_min_tokens_holds_off_the_end_of_sequence(smol_stack):
    chat = [{"role": "user", "content": "Say only the word yes."}]
    async with PlannerClient(smol_stack.addr) as client:
        natural = await client.generate_all(GenerateOptions(chat=chat, max_tokens=24))
        assert natural.finish_reason == "stop" and len(natural.token_ids) < 20
        held = await client.generate_all(
            GenerateOptions(chat=chat, max_tokens=24, min_tokens=len(natural.token_ids) + 3)
        )
    assert len(held.token_ids) >= len(natural.token_ids) + 3
    early = held.token_ids[: len(natural.token_ids) + 2]
    assert not set(smol_stack.planner.eos_token_ids) & set(early)


async def test_seeded_sampling_with_controls_repeats(smol_stack):
    options = dict(text=PROMPT, max_tokens=8, ignore_eos=True, temperature=0.9, min_p=0.05)
    options |= dict(presence_penalty=0.5, logprobs=True)
    async with PlannerClient(smol_stack.addr) as client:
        first = await client.generate_all(GenerateOptions(seed=11, **options))
        again = await client.generate_all(GenerateOptions(seed=11, **options))
    assert first.token_ids == again.token_ids
    assert [e.chosen.logprob for e in first.logprobs] == [e.chosen.logprob for e in again.logprobs]


async def test_a_slot_keeps_no_min_p_of_its_last_request(smol_stack):
    """A seeded request without controls, beside one with controls (so sampled through them), draws the same
    tokens as alone after every slot has held a min_p request: the min_p used to stay on the slot and turn the
    draw near greedy."""
    sampled = GenerateOptions(text=PROMPT, max_tokens=16, ignore_eos=True, temperature=1.5, seed=1234)
    controlled = GenerateOptions(text=PROMPT, max_tokens=24, ignore_eos=True, logprobs=True)
    narrowed = GenerateOptions(text=PROMPT, max_tokens=2, ignore_eos=True, temperature=1.0, min_p=1.0)
    async with PlannerClient(smol_stack.addr) as client:
        slots = (await client.server_info()).free_slots
        await asyncio.gather(*(client.generate_all(narrowed) for _ in range(slots)))  # every slot
        alone = await client.generate_all(sampled)
        beside, _ = await asyncio.gather(client.generate_all(sampled), client.generate_all(controlled))
    assert beside.token_ids == alone.token_ids


async def test_n_choices_share_the_prompt_and_draw_from_their_own_seeds(smol_stack):
    sampled = dict(text=PROMPT * 3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=5)
    async with PlannerClient(smol_stack.addr) as client:
        before = await free_state(smol_stack, client)
        choices = await client.generate_choices(GenerateOptions(n=2, **sampled))
        alone = [await client.generate_all(GenerateOptions(**(sampled | {"seed": seed}))) for seed in (5, 6)]
        assert await free_state(smol_stack, client) == before
    assert [c.index for c in choices] == [0, 1]
    assert [c.token_ids for c in choices] == [a.token_ids for a in alone]
    assert choices[0].token_ids != choices[1].token_ids
    # The second choice read only the prompt's last, partial page: the first's full pages were shared.
    page_size = smol_stack.scheduler.config.page_size
    assert choices[1].read_tokens <= page_size < choices[0].read_tokens


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Berlin", "Rome"]}, "capital": {"type": "boolean"}},
    "required": ["city", "capital"],
    "additionalProperties": False,
}


async def test_json_schema_output_parses_and_validates(smol_stack):
    chat = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    async with PlannerClient(smol_stack.addr) as client:
        before = await free_state(smol_stack, client)
        got = await client.generate_all(
            GenerateOptions(chat=chat, max_tokens=40, response_format=response_format)
        )
        loose = await client.generate_all(
            GenerateOptions(chat=chat, max_tokens=40, response_format={"type": "json_object"})
        )
        assert await free_state(smol_stack, client) == before
    assert got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), SCHEMA)
    if loose.finish_reason == "stop":  # a free-form object may run past max_tokens; what came is JSON so far
        assert isinstance(json.loads(loose.text), dict)
    assert loose.text.lstrip().startswith("{")


async def test_every_choice_of_n_follows_the_schema(smol_stack):
    """n > 1 with a response_format: each choice is constrained, not the first alone, and each is the answer
    its seed gives alone."""
    chat = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    sampled = dict(chat=chat, max_tokens=40, temperature=1.0, seed=11, response_format=response_format)
    async with PlannerClient(smol_stack.addr) as client:
        before = await free_state(smol_stack, client)
        choices = await client.generate_choices(GenerateOptions(n=2, **sampled))
        second_alone = await client.generate_all(GenerateOptions(**(sampled | {"seed": 12})))
        assert await free_state(smol_stack, client) == before
    for choice in choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert choices[1].token_ids == second_alone.token_ids


@pytest.mark.parametrize(
    "schema, named",
    [
        ({"type": "integer", "not": {"const": 3}}, "uses 'not' (at #/properties/a)"),
        # xgrammar follows one of several allOf schemas: {"allOf": [integer, minimum 10]} produced 3.0...0
        (
            {"allOf": [{"type": "integer"}, {"minimum": 10}]},
            "uses 'allOf' with 2 subschemas (at #/properties/a)",
        ),
        ({"type": "string", "enum": ["a", "bb"], "minLength": 2}, "uses 'enum' beside 'minLength'"),
        ({"type": "object", "required": ["b"]}, "uses 'required' naming \"b\", absent from 'properties'"),
    ],
    ids=["not", "allOf", "enum-beside", "required-undeclared"],
)
async def test_a_schema_feature_it_cannot_enforce_is_invalid_argument(smol_stack, schema, named):
    schema = {"type": "object", "properties": {"a": schema}}
    response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    async with PlannerClient(smol_stack.addr) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.generate_all(
                GenerateOptions(text="x", max_tokens=2, response_format=response_format)
            )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in caught.value.details()
    assert caught.value.details().startswith("response_format.json_schema.schema uses ")


async def test_whitespace_cannot_run_to_max_tokens(smol_stack):
    """An object of no properties takes only {}: SmolLM2 opens it and, allowed any whitespace, wrote spaces and
    newlines until max_tokens; capped, it must close it after MAX_JSON_WHITESPACE."""
    schema = {"type": "object", "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "empty", "schema": schema}}
    chat = [{"role": "user", "content": "Give an empty JSON object: {}"}]
    async with PlannerClient(smol_stack.addr) as client:
        got = await client.generate_all(
            GenerateOptions(chat=chat, max_tokens=40, response_format=response_format)
        )
    assert got.finish_reason == "stop" and json.loads(got.text) == {}, got.text


async def test_a_grammar_with_ignore_eos_or_min_tokens_is_invalid_argument(smol_stack):
    """Either would keep a complete JSON value from ending (validation.check_grammar_can_end)."""
    json_object = {"type": "json_object"}
    async with PlannerClient(smol_stack.addr) as client:
        for extra, fields in ((dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=2), "min_tokens")):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.generate_all(
                    GenerateOptions(text="x", max_tokens=4, response_format=json_object, **extra)
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"response_format and {fields} conflict" in caught.value.details()


async def test_a_new_schema_is_compiled_before_any_step_and_the_executor_refuses_a_bad_one(smol_stack):
    """The planner has the executor compile a request's grammar (PrepareGrammar) before submitting it: no
    step waits for a compile. One xgrammar cannot compile is INVALID_ARGUMENT from the executor too."""
    grammars = smol_stack.runner.grammars
    late = grammars.late_compiles
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    async with PlannerClient(smol_stack.addr) as client:
        got = await client.generate_all(
            GenerateOptions(text="A number as JSON:", max_tokens=3, response_format=response_format)
        )
    assert got.text.lstrip().startswith("{") and grammars.late_compiles == late
    bad = executor_pb2.Grammar(json_schema='{"type": "string", "pattern": "(?<=x)y"}')
    async with grpc.aio.insecure_channel(smol_stack.engine.link.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await executor_pb2_grpc.ExecutorStub(channel).PrepareGrammar(bad)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be compiled: " in caught.value.details() and "Lookbehind" in caught.value.details()


async def test_a_turn_whose_grammar_the_executor_refuses_leaves_no_trace(smol_stack):
    """The planner compiles a schema at intake; should its executor still refuse it (PrepareGrammar), the turn
    is a ValueError (INVALID_ARGUMENT) naming response_format and the executor's reason, before anything of its
    conversation is opened: no conversation, lock or pages stay. Called at the turn (intake would refuse
    this schema first; no schema passes one compile and fails the other on one machine)."""
    await smol_stack.wait_idle()
    turns, pages = smol_stack.planner.turns, smol_stack.scheduler.pages.free_count
    req = Request("refused-grammar", [504, 3575, 282], 4, stop_ids=frozenset({2}))
    req.grammar, req.tenant = '{"type": "string", "pattern": "(?<=x)y"}', "default"
    with pytest.raises(ValueError) as caught:
        await turns.start(req, "default", "grammar")
    assert str(caught.value) == (  # the executor's reason in words, without xgrammar's time and C++ source
        "response_format: refused by the executor: control_grammar: the JSON schema cannot be compiled: "
        "Regex parsing error at position 3: Lookbehind is not supported yet."
    )
    assert turns.find("default", "grammar") == (None, None) and ("default", "grammar") not in turns._locks
    assert smol_stack.scheduler.idle and smol_stack.scheduler.pages.free_count == pages
    async with PlannerClient(smol_stack.addr) as client:
        assert "grammar" not in [c.conversation_id for c in await client.conversations()]
