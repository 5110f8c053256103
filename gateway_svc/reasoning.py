"""A reasoning model's thought, apart from its answer: a field beside `content` (`reasoning`, as vLLM's reasoning
parsers give it, or `reasoning_content`, DeepSeek's name). Pure, no I/O.

Qwen3, Qwen3.5 and DeepSeek-R1 think in <think>...</think> before they answer. The chat template may open the
thought in the prompt (Qwen3.5, R1: the planner says so, GenerateResponse.begins_in_thought; a tag the model
writes again there is dropped), or the model opens it as its first words (Qwen3); a template with thinking off
closes an empty one in the prompt, and the answer is all content. A thought cut by max_tokens is all thought: the
answer's content is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway_svc.tool_calls import tag_begun
from protos.thought import THOUGHT_END, THOUGHT_OPEN

# The message field (and the delta's) a thought goes in: vLLM's name now (OpenRouter's too), and DeepSeek's API's
# (vLLM's earlier name).
REASONING_FIELDS = ("reasoning", "reasoning_content")

Phase = Literal["opening", "thought", "answer"]  # opening: the text so far may still be a THOUGHT_OPEN


@dataclass(slots=True)
class ThoughtStream:
    """One choice's text as it streams, split into thought and answer. Text that may be the start of a tag is held
    until the next text says (white space at the start, too, for a thought may open after it)."""

    in_thought: bool  # the prompt opened a thought: text that does not open one (again, as R1 may) is thought
    _phase: Phase = "opening"
    _held: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The (thought, answer) of `text` to send now."""
        held, self._held = self._held + text, ""
        if self._phase == "opening":
            start = held.lstrip()
            if start.startswith(THOUGHT_OPEN):
                self._phase = "thought"
                held = start[len(THOUGHT_OPEN) :]
            elif THOUGHT_OPEN.startswith(start):
                self._held = held
                return "", ""
            else:
                self._phase = "thought" if self.in_thought else "answer"
        if self._phase == "answer":
            return "", held
        end = held.find(THOUGHT_END)
        if end >= 0:
            self._phase = "answer"
            return held[:end], held[end + len(THOUGHT_END) :]
        keep = tag_begun(held, THOUGHT_END)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], ""

    def finish(self) -> tuple[str, str]:
        """At the choice's end: the (thought, answer) still held."""
        held, self._held = self._held, ""
        in_thought = self._phase == "thought" or (self._phase == "opening" and self.in_thought)
        return (held, "") if in_thought else ("", held)


def split_thought(text: str, begins_in_thought: bool) -> tuple[str | None, str]:
    """A whole answer's (thought, content), split as its stream would be; the thought None where there is none (or
    it is empty)."""
    stream = ThoughtStream(begins_in_thought)
    thought, answer = stream.feed(text)
    held_thought, held_answer = stream.finish()
    return (thought + held_thought) or None, answer + held_answer
