"""Conversations kept between turns: their tokens, KV pages and checkpoints, and where a new turn mounts."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner_svc.retention import Retention, RetentionConfig
from planner_svc.state_slots import StateSlots

if TYPE_CHECKING:
    from planner_svc.requests import Request


@dataclass(slots=True)
class Mount:
    """Where a turn starts: its first `reused` prompt tokens are already in `pages`."""

    reused: int = 0
    pages: list[int] = field(default_factory=list)
    checkpoint: str = "none"
    diverged_at: int = -1  # first prompt position that differs from the stored tokens; -1 if none
    state_slot: int = 0  # a model with recurrent layers: the checkpoint's state copy, at position `reused`


@dataclass(slots=True, eq=False)
class Conversation:
    tenant: str
    conversation_id: str
    retention: Retention
    tokens: list[int] = field(default_factory=list)  # tokens whose KV the pages hold (one branch)
    pages: list[int] = field(default_factory=list)  # empty while parked or never read
    parked: bool = False  # its pages live in the cache service
    busy: bool = False  # a turn is running on it
    parking: bool = False  # its executor is copying its pages and states to the cache: they stay its own
    last_used: int = 0
    lost: str = ""  # why its KV was lost with an executor (said once, by its next turn's mount)
    # A model with recurrent layers: each checkpoint's state copy (position -> state slot of `state_pool`).
    states: dict[int, int] = field(default_factory=dict)
    state_pool: StateSlots | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.conversation_id)

    def forget(self) -> list[int]:
        """Drop what was kept (its next turn reads the whole prompt); returns the pages to free."""
        pages = self.pages
        self.tokens, self.pages, self.parked = [], [], False
        self.retention = Retention(self.retention.config)
        self.drop_states(list(self.states))
        return pages

    @property
    def idle(self) -> bool:
        """Neither running a turn nor being parked: what it holds may be taken back under pressure."""
        return not self.busy and not self.parking

    def drop_states(self, positions: list[int]) -> None:
        """The state copies of these checkpoints go back to the pool (no step reads them: no turn runs, or
        its first step, which copied from its mount's, has committed)."""
        for position in positions:
            slot = self.states.pop(position, None)
            if slot is not None and self.state_pool is not None:
                self.state_pool.give_back(slot)

    @property
    def pin_copy(self) -> int:
        """The state slot of its pinned checkpoint's copy; 0: none."""
        pinned = self.retention.pinned
        return self.states.get(pinned, 0) if pinned is not None else 0

    def hand_over_state(self, slot: int) -> None:
        """The turn resuming from the checkpoint holding `slot` takes the slot itself (no slot was free for a
        copy): the checkpoint is gone, the turn's end makes a new one. Never the pin's (Request.brings_state)."""
        assert slot != self.pin_copy, "a pin's state copy is never handed over"
        position = next(p for p, held in self.states.items() if held == slot)
        del self.states[position]
        self.retention.remove(position)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# Records at which the first sweep of emptied conversations runs; each later one waits for twice the records the
# sweep before left, so a sweep costs O(1) a conversation opened.
_FIRST_SWEEP = 1024


class Conversations:
    """The conversations of one executor group, keyed by (tenant, conversation id)."""

    def __init__(self, page_size: int, retention: RetentionConfig, states: StateSlots | None = None):
        self.page_size = page_size
        self.retention = retention
        # The state pool of a model with recurrent layers (the scheduler's): pages alone cannot resume a turn,
        # so each checkpoint holds a copy of the recurrent state at its position in a slot of it.
        self.states = states
        self._by_key: dict[tuple[str, str], Conversation] = {}
        self._clock = 0
        self._sweep_at = _FIRST_SWEEP

    @property
    def recurrent(self) -> bool:
        return self.states is not None and self.states.enabled

    def get(self, tenant: str, conversation_id: str) -> Conversation | None:
        return self._by_key.get((tenant, conversation_id))

    def open(self, tenant: str, conversation_id: str) -> Conversation:
        conversation = self.get(tenant, conversation_id)
        if conversation is None:
            conversation = Conversation(tenant, conversation_id, Retention(self.retention))
            conversation.state_pool = self.states if self.recurrent else None
            self._by_key[conversation.key] = conversation
        return conversation

    def of_tenant(self, tenant: str) -> list[Conversation]:
        return [c for c in self._by_key.values() if c.tenant == tenant]

    def every(self) -> list[Conversation]:
        return list(self._by_key.values())

    def remove(self, conversation: Conversation) -> None:
        self._by_key.pop(conversation.key, None)

    def due_for_sweep(self) -> bool:
        return len(self._by_key) >= self._sweep_at

    def emptied(self) -> list[Conversation]:
        """The records that keep nothing and run nothing: no tokens, pages, snapshot, state copy or note for the
        next turn (a conversation whose KV was dropped under pressure, or whose snapshot the cache evicted)."""
        return [
            c
            for c in self._by_key.values()
            if c.idle and not (c.tokens or c.pages or c.parked or c.busy or c.states or c.lost)
        ]

    def swept(self) -> None:
        self._sweep_at = max(_FIRST_SWEEP, 2 * len(self._by_key))

    def mount(
        self, conversation: Conversation, prompt_ids: list[int], restored: bool = False
    ) -> tuple[Mount, list[int]]:
        """Start a turn: keep the pages up to the longest checkpoint that is an exact prefix of the prompt.

        Returns the mount and the pages the conversation no longer needs (to free). At least one prompt
        token is always left to read, so the turn has logits to sample from.
        """
        self._clock += 1
        conversation.last_used = self._clock
        conversation.busy = True
        common = common_prefix(conversation.tokens, prompt_ids)
        diverged = common if common < len(conversation.tokens) else -1
        if diverged >= 0:
            conversation.drop_states(conversation.retention.drop_after(common))
        # A state is at its checkpoint exactly, so a recurrent model needs one short of the prompt's end; pages
        # are kept whole, so a dense model may mount one at the end and read the last page again.
        limit = min(common, len(prompt_ids) - 1) if self.recurrent else common
        position = conversation.retention.best_prefix(limit)
        if self.recurrent:
            # The state is at `position` exactly: the turn reads on from there, writing the rest of the tail
            # page in place. Nothing else reads those positions: one branch, one turn at a time, no shared
            # pages, and every checkpoint past `position` was dropped above (or covers these same tokens).
            keep = -(-(position or 0) // self.page_size) if conversation.pages else 0
            reused = position or 0
        else:
            # Only whole pages are kept: the turn writes from a page boundary on, never into a kept page
            # (a full page may be indexed for sharing, so its tokens must not change).
            keep = min(position or 0, len(prompt_ids) - 1) // self.page_size if conversation.pages else 0
            reused = keep * self.page_size
        if not keep:
            mount = Mount(diverged_at=diverged)
            if conversation.tokens:
                covers = "holds a state copy within" if self.recurrent else "covers a page of"
                mount.checkpoint = f"none (no retained checkpoint {covers} the {common} common tokens)"
            elif conversation.lost:
                mount.checkpoint = f"none ({conversation.lost})"
            conversation.lost = ""
            if self.recurrent:  # copies past the prompt, with no pages under them
                conversation.drop_states(list(conversation.states))
                conversation.retention = Retention(self.retention)
            release, conversation.pages, conversation.tokens = conversation.pages, [], []
            return mount, release
        assert position is not None  # keep > 0
        conversation.retention.mount(position)
        label = f"{'snapshot' if restored else 'checkpoint'}@{position}"
        mount = Mount(
            reused, conversation.pages[:keep], label, diverged, conversation.states.get(position, 0)
        )
        release = conversation.pages[keep:]
        conversation.pages, conversation.tokens = [], conversation.tokens[:reused]
        return mount, release

    def end_turn(self, request: Request, pages: list[int], state_slot: int) -> list[int]:
        """A turn's steps are done: its conversation keeps the pages of its tokens (returns the rest, to free)
        and, for a model with recurrent layers, its state (`state_slot`) as a checkpoint at their end where
        the state read only tokens it kept (else the slot goes back)."""
        assert request.conversation is not None
        state_tokens = request.state_tokens() if state_slot else None
        if state_slot and state_tokens is None:
            assert self.states is not None
            self.states.give_back(state_slot)
        tokens = state_tokens if state_tokens is not None else request.kv_tokens()
        turn_end = [request.prompt_len] if request.prefilled == request.prompt_len else []
        marks = [p for p in request.state_marks if p <= len(tokens)]
        marked, request.marked_states = request.marked_states, {}
        released = self.finish_turn(
            request.conversation,
            tokens,
            pages,
            list(dict.fromkeys(turn_end + marks)),
            root=request.root,
            pinned=request.pinned,
            state_slot=state_slot if state_tokens is not None else 0,
            marked_states=marked,
        )
        if request.pin_asked:
            request.pin_kept = request.conversation.retention.pinned or 0
            request.pin_note = self._pin_note(request, len(tokens))
        return released

    def _pin_note(self, request: Request, tokens: int) -> str:
        """Why the turn's conversation does not keep its shared prefix as its pin ("" where it does)."""
        assert request.conversation is not None
        if request.pinned is not None and request.pin_kept == request.pinned:
            return ""
        if request.pinned is None:  # not marked: the note says why
            return request.pin_note
        if request.pinned > tokens:
            return "the turn ended before reading the whole prefix"
        return request.pin_note or (
            "the conversation keeps no recurrent state at the prefix (the turn resumed from a checkpoint at or "
            "past it): a hybrid model pins a prefix where a turn reads through it or a checkpoint keeps its state"
        )

    def finish_turn(
        self,
        conversation: Conversation,
        tokens: list[int],
        pages: list[int],
        checkpoints: list[int],
        *,
        root: int | None = None,
        pinned: int | None = None,
        state_slot: int = 0,
        marked_states: dict[int, int] | None = None,
    ) -> list[int]:
        """The turn ended: its tokens' KV is in `pages`; checkpoints are taken at the given positions.

        A model with recurrent layers: `state_slot` is the turn's state, at len(tokens) (0: none, it ended
        before reading its prompt), and `marked_states` its copies at its state marks (position ->
        slot); the conversation takes them as those checkpoints' copies, or gives them back. Its checkpoints
        are those with a copy only (`checkpoints` are not used). Returns the pages beyond the tokens (to
        free)."""
        keep = -(-len(tokens) // self.page_size)
        conversation.tokens, conversation.pages = tokens, pages[:keep]
        conversation.busy = False
        retention = conversation.retention
        conversation.drop_states(retention.drop_after(len(tokens)))  # past what the pages hold now
        if self.recurrent:
            for position, slot in sorted((marked_states or {}).items()):
                self._keep_state(
                    conversation, position, slot, root=position == root, pinned=position == pinned
                )
            self._keep_state(conversation, len(tokens), state_slot)
            if pinned in conversation.states and retention.pinned != pinned:  # a checkpoint's copy already
                conversation.drop_states(retention.pin(pinned))
            return pages[keep:]
        for position in sorted(set(checkpoints)):
            if not 0 < position <= len(tokens):
                continue
            if position not in retention.positions:
                retention.add(position, root=position == root, pinned=position == pinned)
            elif position == pinned and retention.pinned != position:
                retention.pin(position)
        return pages[keep:]

    def _keep_state(
        self,
        conversation: Conversation,
        position: int,
        slot: int,
        *,
        root: bool = False,
        pinned: bool = False,
    ) -> None:
        """A checkpoint at `position` holding the state in `slot` (a newer copy replaces one kept there); the
        copies of those retention evicts go back. With one state slot in all, none is kept: a kept copy
        would leave the turn resuming from it no slot to run in."""
        assert self.states is not None
        if not slot:
            return
        if not 0 < position <= len(conversation.tokens) or self.states.total < 2:
            self.states.give_back(slot)
            return
        conversation.drop_states([position])
        conversation.states[position] = slot
        conversation.drop_states(conversation.retention.add(position, root=root, pinned=pinned))

    def drop_state_copy(self) -> list[int] | None:
        """State-slot pressure: the least recently used idle conversation holding a copy other than its pin's
        gives one back: its retention's victim, else its newest. A pin's copy is never given back, as retention
        never evicts a pin: with the pin left, the conversation keeps it and its pages (its next turn resumes
        from the pin); with nothing left, it forgets what it kept. Returns the pages to free; None when no idle
        conversation holds such a copy."""
        idle = [c for c in self._by_key.values() if c.idle and set(c.states) - {c.retention.pinned}]
        conversation = min(idle, key=lambda c: c.last_used, default=None)
        if conversation is None:
            return None
        retention = conversation.retention
        victim = retention.evict_one()
        if victim is None:  # only the newest is left besides a pin
            if retention.pinned is None:
                return conversation.forget()
            victim = retention.positions[-1]
            retention.remove(victim)
        conversation.drop_states([victim])
        return []

    def coldest_idle(
        self, with_states: bool = False, excluding: Collection[tuple[str, str]] = ()
    ) -> Conversation | None:
        """The least recently used conversation holding pages (`with_states`: and state copies), neither running
        a turn nor being parked, nor one of `excluding` (keys)."""
        idle = [
            c
            for c in self._by_key.values()
            if c.pages and c.idle and (c.states or not with_states) and c.key not in excluding
        ]
        return min(idle, key=lambda c: c.last_used, default=None)
