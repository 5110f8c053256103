"""Hugging Face reference for parity tests: the same GGUF in transformers, greedy generation, chat prompts."""

from __future__ import annotations

import functools
import os

import torch

from protos.model_files import default_model_path

EOS_TOKEN_ID = 2


def _model_dir_and_file() -> tuple[str, str]:
    path = default_model_path()
    return os.path.dirname(path), os.path.basename(path)


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    directory, name = _model_dir_and_file()
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@functools.cache
def hf_model():
    from transformers import AutoModelForCausalLM

    directory, name = _model_dir_and_file()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


def hf_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Generated ids only, greedy, stopping after EOS (included) like `generate(do_sample=False)`."""
    with torch.inference_mode():
        out = hf_model().generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=EOS_TOKEN_ID,
            pad_token_id=EOS_TOKEN_ID,
        )
    return out[0, len(prompt_ids) :].tolist()


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    encoded = hf_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    return list(encoded["input_ids"])


def _facts_prompt() -> list[dict[str, str]]:
    subjects = [
        "the river",
        "the old mill",
        "the lighthouse",
        "the library",
        "the orchard",
        "the bridge",
        "the market",
    ]
    verbs = ["was built in", "was repaired in", "was painted in", "first opened in", "was flooded in"]
    lines = [
        f"{i + 1}. {subjects[i % 7].capitalize()} {verbs[i % 5]} {1700 + (i * 37) % 300}." for i in range(110)
    ]
    return [
        {
            "role": "user",
            "content": "Here are some facts about a town:\n"
            + "\n".join(lines)
            + "\n\nWhich fact mentions the lighthouse first, and what year does it give?",
        }
    ]


def _document_prompt() -> list[dict[str, str]]:
    paragraph = (
        "Section {n}. The committee met on day {d} to review the water supply. Member {m} reported that "
        "reservoir levels had changed by {p} percent since the previous meeting, and proposed that the "
        "pumping schedule be adjusted before the dry season. The proposal was {o}."
    )
    sections = [
        paragraph.format(
            n=n, d=3 * n + 1, m="ABCDEFG"[n % 7], p=(n * 13) % 40 - 20, o="accepted" if n % 3 else "deferred"
        )
        for n in range(1, 25)
    ]
    return [
        {"role": "system", "content": "You are a careful assistant who summarises documents."},
        {
            "role": "user",
            "content": "Document:\n\n"
            + "\n\n".join(sections)
            + "\n\nSummarise the document in two sentences.",
        },
    ]


def _conversation_prompt() -> list[dict[str, str]]:
    messages = []
    for turn in range(14):
        messages.append(
            {
                "role": "user",
                "content": f"Tell me something about the number {turn * 7 + 3} "
                f"and how it relates to the number {turn * 11 + 5}, in a few sentences.",
            }
        )
        messages.append(
            {
                "role": "assistant",
                "content": f"The number {turn * 7 + 3} is "
                f"{'odd' if (turn * 7 + 3) % 2 else 'even'}, and {turn * 11 + 5} is "
                f"{'odd' if (turn * 11 + 5) % 2 else 'even'}. Their sum is {turn * 18 + 8} and their "
                f"difference is {abs(turn * 4 + 2)}. Both appear often in puzzles and counting games.",
            }
        )
    messages.append({"role": "user", "content": "Now, what was the first number I asked you about?"})
    return messages


def chat_prompts() -> list[list[dict[str, str]]]:
    """Eight chat message lists: five short, then three of over 1,000 tokens each (deterministic)."""
    short = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What colour is the sky?"},
        ],
        [{"role": "user", "content": "List three prime numbers."}],
        [{"role": "user", "content": "Explain gravity to a child."}],
    ]
    return short + [_facts_prompt(), _document_prompt(), _conversation_prompt()]
