"""A request's host truth: prompt, sampling, pages, progress and the tokens it has produced."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner_svc.pages import page_hashes

if TYPE_CHECKING:
    from planner_svc.conversations import Conversation


class Finish(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, no pages yet
    PREFILL = "prefill"  # all its pages held, prompt being read chunk by chunk
    DECODE = "decode"  # prompt read, one token a step
    DONE = "done"  # finished; pages and slot return once its last step commits


@dataclass(slots=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # The sampling controls (client.proto's SamplingParams; sampler_state.py sends them with the slot's row)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    top_logprobs: int = -1  # -1: no logprobs; else the alternatives returned with each token (0-20)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):  # also refuses NaN: the executor would refuse the step
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")


@dataclass(slots=True)
class PrefillRead:
    began: float  # when its first chunk was planned
    first: int  # tokens already there then (reused pages)
    shown: float  # when its last line was logged


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()  # matched on the streamed text (stop_strings.py)
    min_tokens: int = 0  # no stop before this many output tokens
    grammar: str | None = None  # structured output: "" any JSON object, else a JSON Schema's text
    choices: list[Request] = field(
        default_factory=list
    )  # n > 1: the other choices let in so far (choices.py)
    n: int = 1  # choices of its prompt wanted (n > 1: this is the first; choices.py lets in the others)
    later_choice: bool = False  # choice 2 to n: queued at its first's place, charged with the first

    phase: Phase = Phase.WAITING
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens written into the pool
    kv_len: int = 0  # stored length, while the request holds no slot (the mirror has it otherwise)
    stale: bool = True  # its device row must be written whole before a decode reads it
    last_seq: int = -1  # the last step that read or wrote its pages or slot
    state_slot: int = 0  # its recurrent-state slot from admission to its last step's commit (0: none)
    state_source: int = 0  # its checkpoint's state copy (a resumed turn), copied in by its first chunk
    marked_states: dict[int, int] = field(default_factory=dict)  # its state at its state_marks: their slots
    output_ids: list[int] = field(default_factory=list)
    finish: Finish | None = None
    refused: str = ""  # the status it was refused with while waiting, never admitted (Engine.refuse)

    # Reuse of KV already in the pool: a conversation's mounted pages, or a shared prefix.
    conversation: Conversation | None = None
    reused: int = 0  # prompt tokens whose KV `pages` already hold at admission
    prefill_read: PrefillRead | None = None  # a long prompt's read being followed (prefill_progress.py)
    begins_in_thought: bool = False  # a chat whose template opened a thought: its text begins inside one
    root: int | None = None  # end of the system prompt: a checkpoint kept while the cap allows
    pinned: int | None = None  # a shared read-only prefix: a checkpoint never evicted
    pin_asked: bool = False  # the turn asked for a shared prefix (its last message reports the pin kept)
    pin_note: str = ""  # why the conversation may not keep `pinned` as its pin (set where that is found)
    pin_kept: int = 0  # the pin its conversation kept when its turn ended (0: none), where it asked for one
    released: bool = False  # its steps are done and its pages went back (to its conversation, or the pool)
    tenant: str = ""  # whose request: the seed of its prefix hashes (pages are shared within a tenant only)
    queue_tag: int = 0  # its place in the waiting queue, where tenants take turns (tenant_order.py)
    admitted_at: float = 0.0  # time.perf_counter() when admission gave it its pages (0: not admitted)
    # reusable_hashes', made once for a page size and tenant
    _reusable: tuple[int, str, list[bytes]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")

    def take(self, token: int) -> Finish | None:
        """Append its next output token; the finish it brings (a stop token, or max_tokens reached)."""
        self.output_ids.append(token)
        if token in self.stop_ids:
            self.finish = Finish.STOP
        elif len(self.output_ids) >= self.max_tokens:
            self.finish = Finish.LENGTH
        return self.finish

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def end_len(self) -> int:
        """Stored length at which the request has been scheduled for all of its max_tokens.

        The prompt's last chunk samples token 1; each decode step at stored length L samples one more,
        so decode runs while L < prompt_len + max_tokens - 1.
        """
        return self.prompt_len + self.max_tokens - 1

    def kv_tokens(self) -> list[int]:
        """The tokens whose KV its pages hold once its steps are done (the last sampled one has none)."""
        if self.phase is Phase.DONE and self.output_ids and self.prefilled == self.prompt_len:
            return self.prompt_ids + self.output_ids[:-1]
        return self.prompt_ids[: self.prefilled]

    @property
    def state_marks(self) -> tuple[int, ...]:
        """Where a hybrid turn copies its state on the way (state_marks.py): the root and pin marks, and, for a
        turn a stop string may end, its prompt's end: such a turn is ended steps after its state read on, so
        its end keeps no state, and without this copy its conversation would keep no checkpoint at all."""
        ends = (self.prompt_len,) if self.stop_strings else ()
        return tuple(dict.fromkeys(m for m in (self.root, self.pinned, *ends) if m is not None))

    def state_tokens(self) -> list[int] | None:
        """The tokens its recurrent state has read once its steps are done (kv_len of them: a run after its
        stop included); None before its prompt was read, or where that includes a token it dropped."""
        if self.phase is not Phase.DONE or self.prefilled < self.prompt_len:
            return None
        known = self.prompt_ids + self.output_ids
        return known[: self.kv_len] if self.kv_len <= len(known) else None

    def reusable_hashes(self, page_size: int) -> list[bytes]:
        """The hashes of the prompt's full pages a prefix match may take (one token at least is left to read,
        for its logits); made once: admission asks at each plan while the request waits."""
        if self._reusable is None or self._reusable[:2] != (page_size, self.tenant):
            hashes = self.prefix_hashes((self.prompt_len - 1) // page_size * page_size, page_size)
            self._reusable = (page_size, self.tenant, hashes)
        return self._reusable[2]

    def prefix_hashes(self, tokens: int, page_size: int) -> list[bytes]:
        """The hashes of the full pages of the prompt's first `tokens` tokens, seeded by its tenant."""
        return page_hashes(self.prompt_ids[:tokens], page_size, self.tenant)

    def pages_needed(self, page_size: int) -> int:
        """Pages for every position it can write: the prompt and all but its last sampled token."""
        return -(-self.end_len // page_size)

    @property
    def brings_state(self) -> bool:
        """It needs no free recurrent-state slot: it holds one, or takes its checkpoint's. Never a pin's: that
        copy stays the pin's, so a turn resuming from its pin copies it into a free slot."""
        if self.state_slot:
            return True
        pin = self.conversation.pin_copy if self.conversation is not None else 0
        return bool(self.state_source) and self.state_source != pin
