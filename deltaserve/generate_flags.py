"""The `generate` command's flags and its prompt: from the command line or exactly one environment variable."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

from deltaserve.flag_groups import add_client_trust_flags
from deltaserve.flags import (
    INT32_MAX,
    Flags,
    address,
    env_name,
    int_at_least,
    json_object,
    shared_prefix,
    token_ids,
)
from deltaserve.sampling_flags import add_sampling_flags
from deltaserve.serve import PLANNER_PORT

GENERATE_HELP = "send one prompt to a planner and stream the answer to stdout"


def add_generate_command(generate: Flags) -> None:
    generate.option(
        "--addr", type=address, default=f"127.0.0.1:{PLANNER_PORT}", metavar="HOST:PORT", help="the planner"
    )
    prompt = generate.parser.add_mutually_exclusive_group()
    # The prompt's variables are read after parsing (see resolve_prompt): exactly one prompt in all.
    prompt.add_argument("--text", help=f"the prompt as plain text [env {env_name('--text')}]")
    prompt.add_argument(
        "--chat-json",
        metavar="FILE",
        help='a JSON list of {"role": ..., "content": ...} messages; - reads stdin '
        f"[env {env_name('--chat-json')}]",
    )
    prompt.add_argument(
        "--token-ids",
        type=token_ids,
        metavar="1,2,3",
        help=f"the prompt as token ids [env {env_name('--token-ids')}]",
    )
    generate.option(
        "--chat-template-kwargs",
        type=json_object,
        metavar="JSON",
        help="more variables for the model's chat template (with --chat-json), e.g. '{\"enable_thinking\": false}'",
    )
    generate.option(
        "--max-tokens",
        type=int_at_least(1, INT32_MAX),
        required=True,
        metavar="N",
        help="tokens to generate at most",
    )
    add_sampling_flags(generate)
    generate.option(
        "--request-id", metavar="ID", help="unique among running requests (default: the planner makes one)"
    )
    generate.option(
        "--conversation",
        metavar="ID",
        help="continue this conversation: the prompt carries the whole history, and the planner reads only "
        "what follows its longest kept checkpoint",
    )
    generate.option(
        "--tenant", default="", metavar="T", help="the owner of the conversation (with an API key: the key's)"
    )
    add_client_trust_flags(generate)
    generate.option(
        "--shared-prefix",
        type=shared_prefix,
        metavar="SPEC",
        help="pin a read-only start of the conversation's prompt: messages:K (the first K chat messages), "
        "message:I:N (those before I and N characters of message I) or tokens:N",
    )
    generate.switch(
        "--json",
        help="print one JSON object at the end instead of streaming the text (with reused_tokens, "
        "read_tokens, checkpoint, diverged_at, the seed, drawn by the planner where --seed is not given, and "
        "with --shared-prefix the pinned_prefix kept and a pin_note where it is not the one asked for)",
    )


_PROMPT_FLAGS = {"text": "--text", "chat_json": "--chat-json", "token_ids": "--token-ids"}


def resolve_prompt(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> None:
    """Exactly one prompt: from the command line, else from exactly one environment variable."""
    if all(getattr(args, dest) is None for dest in _PROMPT_FLAGS):
        from_env = [(dest, flag) for dest, flag in _PROMPT_FLAGS.items() if env_name(flag) in environ]
        if len(from_env) > 1:
            parser.error(
                "more than one prompt in the environment: " + ", ".join(env_name(f) for _, f in from_env)
            )
        if not from_env:
            parser.error("a prompt is required: --text, --chat-json or --token-ids")
        dest, flag = from_env[0]
        raw = environ[env_name(flag)]
        try:
            setattr(args, dest, token_ids(raw) if dest == "token_ids" else raw)
        except ValueError as error:
            parser.error(f"{env_name(flag)}={raw!r}: {error}")
    if args.chat_json is not None:
        args.chat = _read_chat(parser, args.chat_json)
    else:
        args.chat = None
        variable = environ.get(env_name("--chat-template-kwargs"))
        if variable is not None and args.chat_template_kwargs == json_object(variable):
            args.chat_template_kwargs = None  # the variable is for chats, and harms no other prompt
        elif args.chat_template_kwargs:
            parser.error("--chat-template-kwargs are variables of the chat template: give --chat-json")


def _read_chat(parser: argparse.ArgumentParser, path: str) -> list[dict[str, str]]:
    try:
        if path == "-":
            chat = json.load(sys.stdin)
        else:
            with open(path, encoding="utf-8") as file:
                chat = json.load(file)
    except (OSError, ValueError) as error:  # ValueError: JSONDecodeError, UnicodeDecodeError
        parser.error(f"--chat-json {path}: {error}")
    except RecursionError:
        parser.error(f"--chat-json {path}: it nests too deep for a chat")
    well_formed = (
        isinstance(chat, list)
        and chat
        and all(
            isinstance(m, dict)
            and set(m) == {"role", "content"}
            and all(isinstance(v, str) for v in m.values())
            for m in chat
        )
    )
    if not well_formed:
        parser.error(
            f'--chat-json {path}: expected a non-empty JSON list of {{"role": str, "content": str}} objects'
        )
    return chat
