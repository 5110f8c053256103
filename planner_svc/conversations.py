"""Conversations kept between turns: their tokens, KV pages and checkpoints, and where a new turn mounts."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner_svc.retention import Retention, RetentionConfig


@dataclass(slots=True)
class Mount:
    """Where a turn starts: its first `reused` prompt tokens are already in `pages`."""

    reused: int = 0
    pages: list[int] = field(default_factory=list)
    checkpoint: str = "none"
    diverged_at: int = -1  # first prompt position that differs from the stored tokens; -1 if none


@dataclass(slots=True, eq=False)
class Conversation:
    tenant: str
    conversation_id: str
    retention: Retention
    tokens: list[int] = field(default_factory=list)  # tokens whose KV the pages hold (one branch)
    pages: list[int] = field(default_factory=list)  # empty while parked or never read
    parked: bool = False  # its pages live in the cache service
    busy: bool = False  # a turn is running on it
    last_used: int = 0
    lost: str = ""  # why its KV was lost with an executor (said once, by its next turn's mount)

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.conversation_id)

    def forget(self) -> list[int]:
        """Drop what was kept (its next turn reads the whole prompt); returns the pages to free."""
        pages = self.pages
        self.tokens, self.pages, self.parked = [], [], False
        self.retention = Retention(self.retention.config)
        return pages


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Conversations:
    """The conversations of one executor group, keyed by (tenant, conversation id)."""

    def __init__(self, page_size: int, retention: RetentionConfig, recurrent: bool = False):
        self.page_size = page_size
        self.retention = retention
        # A model with recurrent layers: pages alone cannot resume a turn (the state at the checkpoint is not
        # kept), so every turn reads its history again.
        self.recurrent = recurrent
        self._by_key: dict[tuple[str, str], Conversation] = {}
        self._clock = 0

    def get(self, tenant: str, conversation_id: str) -> Conversation | None:
        return self._by_key.get((tenant, conversation_id))

    def open(self, tenant: str, conversation_id: str) -> Conversation:
        conversation = self.get(tenant, conversation_id)
        if conversation is None:
            conversation = Conversation(tenant, conversation_id, Retention(self.retention))
            self._by_key[conversation.key] = conversation
        return conversation

    def of_tenant(self, tenant: str) -> list[Conversation]:
        return [c for c in self._by_key.values() if c.tenant == tenant]

    def every(self) -> list[Conversation]:
        return list(self._by_key.values())

    def remove(self, conversation: Conversation) -> None:
        self._by_key.pop(conversation.key, None)

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
            conversation.retention.drop_after(common)
        position = conversation.retention.best_prefix(min(common, len(prompt_ids) - 1))
        # Only whole pages are kept: the turn writes from a page boundary on, never into a kept page
        # (a full page may be indexed for sharing, so its tokens must not change).
        keep = (position or 0) // self.page_size if conversation.pages else 0
        if not keep:
            mount = Mount(diverged_at=diverged)
            if conversation.tokens and self.recurrent:
                mount.checkpoint = "none (a model with recurrent layers keeps no state at checkpoints yet)"
            elif conversation.tokens:
                mount.checkpoint = (
                    f"none (no retained checkpoint covers a page of the {common} common tokens)"
                )
            elif conversation.lost:
                mount.checkpoint = f"none ({conversation.lost})"
            conversation.lost = ""
            release, conversation.pages, conversation.tokens = conversation.pages, [], []
            return mount, release
        assert position is not None  # keep > 0
        conversation.retention.mount(position)
        reused = keep * self.page_size
        label = f"{'snapshot' if restored else 'checkpoint'}@{position}"
        mount = Mount(reused, conversation.pages[:keep], label, diverged)
        release = conversation.pages[keep:]
        conversation.pages, conversation.tokens = [], conversation.tokens[:reused]
        return mount, release

    def finish_turn(
        self,
        conversation: Conversation,
        tokens: list[int],
        pages: list[int],
        checkpoints: list[int],
        *,
        root: int | None = None,
        pinned: int | None = None,
    ) -> list[int]:
        """The turn ended: its tokens' KV is in `pages`; checkpoints are taken at the given positions.

        Returns the pages beyond the tokens (to free): all of them for a model with recurrent layers, whose
        pages alone cannot resume a turn (nothing to keep, park or restore)."""
        keep = 0 if self.recurrent else -(-len(tokens) // self.page_size)
        conversation.tokens, conversation.pages = tokens, pages[:keep]
        conversation.busy = False
        if self.recurrent:
            return pages
        retention = conversation.retention
        for position in sorted(set(checkpoints)):
            if not 0 < position <= len(tokens):
                continue
            if position not in retention.positions:
                retention.add(position, root=position == root, pinned=position == pinned)
            elif position == pinned and retention.pinned != position:
                retention.pin(position)
        return pages[keep:]

    def coldest_idle(self) -> Conversation | None:
        """The least recently used conversation holding pages and not running a turn."""
        idle = [c for c in self._by_key.values() if c.pages and not c.busy]
        return min(idle, key=lambda c: c.last_used, default=None)
