"""The sampling flags of `deltaserve generate` (and their value parsers): what to sample, when to stop, what to
return."""

from __future__ import annotations

import json

from deltaserve.flags import INT32_MAX, UINT64_MAX, BadValue, Flags, float_in, int_at_least, int_list


def stop_string(text: str) -> list[str]:
    """One stop string a flag (commas are part of it)."""
    if not text:
        raise BadValue("a stop string cannot be empty")
    return [text]


def logit_biases(text: str) -> list[tuple[int, float]]:
    """'ID:BIAS[,ID:BIAS...]' -> [(id, bias), ...]."""
    pairs = []
    for part in filter(None, text.replace(" ", ",").split(",")):
        token, _, bias = part.partition(":")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise BadValue(f"expected ID:BIAS pairs (like 50256:-100), got {text!r}") from None
        if not 0 <= pairs[-1][0] <= INT32_MAX:
            raise BadValue(f"expected token ids in 0..{INT32_MAX}, got {pairs[-1][0]}")
    return pairs


def json_schema_file(path: str) -> dict:
    """A JSON Schema file -> the response_format that constrains the output to it."""
    try:
        with open(path, encoding="utf-8") as file:
            schema = json.load(file)
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BadValue(f"cannot read a JSON schema from {path}: {error}") from None
    except RecursionError:
        raise BadValue(f"cannot read a JSON schema from {path}: it nests too deep") from None
    return {"type": "json_schema", "json_schema": {"name": path, "schema": schema, "strict": True}}


def add_sampling_flags(generate: Flags) -> None:
    generate.option("--temperature", type=float_in(0.0, 100.0), default=0.0, metavar="T", help="0 is greedy")
    generate.option(
        "--top-p",
        type=float_in(0.0, 1.0, low_open=True),
        default=1.0,
        metavar="P",
        help="nucleus sampling mass",
    )
    generate.option(
        "--top-k", type=int_at_least(0, INT32_MAX), default=0, metavar="K", help="0 means no top-k cut"
    )
    generate.option(
        "--min-p",
        type=float_in(0.0, 1.0),
        default=0.0,
        metavar="P",
        help="keep only tokens at least P times as likely as the best one (0 is off)",
    )
    generate.option(
        "--seed",
        type=int_at_least(0, UINT64_MAX),
        default=None,
        metavar="S",
        help="the request's own random stream: a seeded request repeats exactly (unset: the planner draws one)",
    )
    generate.option(
        "--repetition-penalty",
        type=float_in(0.1, 10.0),
        default=1.0,
        metavar="R",
        help="divide positive (multiply negative) logits of tokens already in the prompt or output (1 is off)",
    )
    generate.option(
        "--frequency-penalty",
        type=float_in(-2.0, 2.0),
        default=0.0,
        metavar="F",
        help="subtract F times a token's count in the output from its logit",
    )
    generate.option(
        "--presence-penalty",
        type=float_in(-2.0, 2.0),
        default=0.0,
        metavar="P",
        help="subtract P from the logit of every token already in the output",
    )
    generate.repeated(
        "--logit-bias",
        type=logit_biases,
        metavar="ID:BIAS[,...]",
        help="add BIAS (-100 to 100) to a token's logit",
    )
    generate.repeated(
        "--stop", type=stop_string, metavar="TEXT", help="stop where the output's text reaches TEXT (up to 4)"
    )
    generate.repeated(
        "--stop-token-ids",
        type=int_list,
        metavar="ID[,ID...]",
        help="stop when one of these tokens is generated (besides the model's EOS)",
    )
    generate.switch("--ignore-eos", help="do not stop at the model's end-of-sequence token")
    generate.option(
        "--min-tokens",
        type=int_at_least(0, INT32_MAX),
        default=0,
        metavar="N",
        help="no end-of-sequence or stop token before N tokens",
    )
    generate.option(
        "--n", type=int_at_least(1, INT32_MAX), default=1, metavar="N", help="choices from the one prompt"
    )
    generate.switch("--logprobs", help="return each token's log-probability (printed with --json)")
    generate.option(
        "--top-logprobs",
        type=int_at_least(0, INT32_MAX),
        default=0,
        metavar="K",
        help="and the K (up to 20) most likely alternatives at each step (needs --logprobs)",
    )
    generate.switch("--json-object", help="constrain the output to a JSON object")
    generate.option(
        "--json-schema",
        type=json_schema_file,
        metavar="FILE",
        help="constrain the output to this JSON Schema",
    )
