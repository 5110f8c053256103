"""Retention: spread and lru run turn by turn, the root/pin/newest rules, then a soak against an oracle."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from planner_svc.retention import Retention, RetentionConfig

TURN = 1000
SYSTEM_PROMPT = 1000  # the root: end of the system prompt


def conversation(policy: str, turns: int, *, cap: int = 6, root: bool = True, each_turn=None) -> Retention:
    """Checkpoints at the end of every turn's prompt, as the planner takes them; each_turn(t, r) then."""
    retention = Retention(RetentionConfig(cap=cap, policy=policy))
    base = 0
    if root:
        retention.add(SYSTEM_PROMPT, root=True)
        base = SYSTEM_PROMPT
    for turn in range(1, turns + 1):
        evicted = retention.add(base + turn * TURN)
        assert len(evicted) <= 1 and len(retention.positions) <= cap
        if each_turn:
            each_turn(turn, retention)
    return retention


def distances(retention: Retention) -> list[int]:
    """How far back from the newest each kept checkpoint lies, nearest first."""
    newest = retention.positions[-1]
    return [newest - p for p in reversed(retention.positions)]


def gap_growth(retention: Retention) -> float:
    """Geometric mean of the ratios of successive gaps between kept checkpoints, back from the newest."""
    back = distances(retention)
    gaps = [b - a for a, b in zip(back, back[1:])]
    ratios = [b / a for a, b in zip(gaps, gaps[1:])]
    return math.prod(ratios) ** (1 / len(ratios))


def resume_after_edit(retention: Retention, edited_back: int) -> int:
    """A prompt that rewrites history `edited_back` tokens before the newest: where it resumes from."""
    common = retention.positions[-1] - edited_back
    resume = retention.best_prefix(common)
    retention.drop_after(common)
    retention.mount(resume)
    return resume


def test_config_is_checked():
    with pytest.raises(ValueError):
        RetentionConfig(cap=0)
    with pytest.raises(ValueError):
        RetentionConfig(cap=4, policy="fifo")


@pytest.mark.parametrize("root", [True, False])
def test_spread_thins_out_geometrically_turn_by_turn(root):
    def shape(turn, retention):
        if turn >= 30:  # past the warm-up, every turn: dense at the end, gaps growing back from it
            back = distances(retention)
            assert back[:2] == [0, TURN]
            assert gap_growth(retention) >= 1.5, back
            oldest_turn = [p for p in retention.positions if p != retention.root][0]
            assert retention.positions[-1] - oldest_turn >= turn * TURN // 10, back

    retention = conversation("spread", 200, root=root, each_turn=shape)
    print(f"\nspread, 200 turns, root={root}: kept {distances(retention)} tokens back")
    assert [p for p in retention.positions if p != retention.root][0] <= retention.positions[-1] - 40_000
    if root:
        assert distances(retention) == [0, 1000, 3000, 8000, 43_000, 200_000]  # the reference's numbers


def test_lru_keeps_only_the_last_turns():
    def recent(turn, retention):
        assert retention.root == SYSTEM_PROMPT
        assert all(back <= 5 * TURN for back in distances(retention)[:-1])

    retention = conversation("lru", 200, each_turn=recent)
    print(f"\nlru, 200 turns: kept {distances(retention)} tokens back")


@pytest.mark.parametrize("edited_back, spread_resume_back", [(6000, 8000), (42_000, 43_000)])
def test_an_edit_back_in_history_resumes_near_it_under_spread(edited_back, spread_resume_back):
    spread = conversation("spread", 200)
    newest = spread.positions[-1]
    resume = resume_after_edit(spread, edited_back)
    assert newest - resume == spread_resume_back
    assert spread.positions[-1] == resume  # what followed the edit is gone
    lru = conversation("lru", 200)
    assert resume_after_edit(lru, edited_back) == SYSTEM_PROMPT == lru.root


def test_spread_rereads_far_less_than_lru_over_a_whole_conversation():
    reread = {}
    for policy in ("spread", "lru"):
        total = 0

        def edits(turn, retention):
            nonlocal total
            for edited_back in (2000, 6000, 20_000, 42_000):
                common = retention.positions[-1] - edited_back
                if common >= 0:
                    total += common - (retention.best_prefix(common) or 0)

        conversation(policy, 200, each_turn=edits)
        reread[policy] = total
    print(f"\ntokens read again after edits 2K, 6K, 20K, 42K back at every turn: {reread}")
    assert 3 * reread["spread"] < reread["lru"]


@pytest.mark.parametrize("policy", ["lru", "spread"])
@pytest.mark.parametrize("cap", [2, 3, 6])
def test_the_root_stays_while_the_cap_allows_root_and_leaf(policy, cap):
    retention = conversation(policy, 50, cap=cap)
    assert retention.root == SYSTEM_PROMPT == retention.positions[0]
    assert retention.positions[-1] == SYSTEM_PROMPT + 50 * TURN


@pytest.mark.parametrize("policy", ["lru", "spread"])
def test_cap_one_keeps_only_the_newest_root_included(policy):
    retention = Retention(RetentionConfig(cap=1, policy=policy))
    assert retention.add(500, root=True) == []
    assert retention.add(1500) == [500]
    assert retention.positions == [1500] and retention.root is None
    assert retention.add(2500) == [1500]


@pytest.mark.parametrize("policy", ["lru", "spread"])
@pytest.mark.parametrize("cap", [1, 2, 3, 6])
def test_a_pin_is_never_evicted(policy, cap):
    retention = Retention(RetentionConfig(cap=cap, policy=policy))
    retention.add(SYSTEM_PROMPT, root=True)
    retention.add(4000, pinned=True)  # a long shared document after the system prompt
    for turn in range(1, 60):
        retention.add(4000 + turn * TURN)
        assert retention.pinned == 4000 and 4000 in retention.positions
    assert len(retention.positions) == max(cap, 2)  # cap 1: the pin and the newest
    assert (retention.root == SYSTEM_PROMPT) == (cap >= 3)  # cap 2: no candidate but the root


def test_one_pin_at_a_time_the_old_one_becomes_ordinary():
    retention = Retention(RetentionConfig(cap=1, policy="lru"))
    retention.add(1000, pinned=True)
    assert retention.add(2000) == []  # over the cap by the pin alone
    assert retention.pin(2000) == [1000]
    assert retention.pinned == 2000 and retention.positions == [2000]
    with pytest.raises(KeyError):
        retention.pin(1000)


def test_a_pin_marked_inside_retained_history():
    retention = conversation("spread", 10, cap=4)
    newest = retention.positions[-1]
    evicted = retention.add(5500, pinned=True)
    assert 5500 in retention.positions and retention.positions[-1] == newest
    assert len(evicted) == 1 and evicted[0] not in (newest, SYSTEM_PROMPT)


def test_a_mount_re_dates_only_the_checkpoint_used():
    retention = Retention(RetentionConfig(cap=4, policy="lru"))
    for position in (1000, 2000, 3000, 4000):
        retention.add(position)
    retention.mount(1000)
    assert [retention.add(p)[0] for p in (5000, 6000, 7000, 8000)] == [2000, 3000, 4000, 1000]
    with pytest.raises(KeyError):
        retention.mount(1234)


def test_adding_a_kept_position_again_re_dates_it():
    retention = Retention(RetentionConfig(cap=3, policy="lru"))
    for position in (1000, 2000, 3000):
        retention.add(position)
    assert retention.add(1000) == [] and retention.positions == [1000, 2000, 3000]
    assert retention.add(4000) == [2000]
    with pytest.raises(ValueError):
        retention.add(0)


def test_best_prefix_is_the_longest_kept_checkpoint_within_the_common_prefix():
    retention = Retention(RetentionConfig(cap=4))
    for position in (100, 700, 1500):
        retention.add(position)
    assert retention.best_prefix(99) is None
    found = [retention.best_prefix(n) for n in (100, 699, 700, 1499, 1500, 10**6)]
    assert found == [100, 100, 700, 700, 1500, 1500]


def test_drop_after_drops_what_is_no_longer_a_prefix():
    retention = Retention(RetentionConfig(cap=6))
    retention.add(100, root=True)
    for position in (300, 500, 900):
        retention.add(position, pinned=position == 500)
    assert retention.drop_after(500) == [900]  # the checkpoint at the divergence itself is still a prefix
    assert retention.drop_after(250) == [300, 500]
    assert retention.pinned is None and retention.root == 100
    assert retention.drop_after(0) == [100] and retention.root is None and retention.positions == []


class Oracle:
    """The eviction rules written out plainly, brute force, to check Retention against."""

    def __init__(self, cap: int, policy: str) -> None:
        self.cap, self.policy = cap, policy
        self.used: dict[int, int] = {}  # position -> clock of last add or mount
        self.clock = 0
        self.root = self.pinned = None

    def touch(self, position):
        self.clock += 1
        self.used[position] = self.clock

    def score(self, position):
        if self.policy == "lru":
            return (self.used[position],)
        kept = sorted(self.used)
        older = [p for p in kept if p < position]
        prev = older[-1] if older else 0
        next_ = min(p for p in kept if p > position)
        return (Fraction(next_ - prev, kept[-1] - prev), self.used[position])

    def evict(self):
        evicted = []
        while len(self.used) > self.cap:
            others = [p for p in self.used if p != max(self.used) and p != self.pinned]
            candidates = [p for p in others if p != self.root or self.cap < 2]
            pool = candidates or others
            if not pool:
                break
            victim = min(pool, key=self.score)
            evicted.append(victim)
            self.forget([victim])
        return evicted

    def forget(self, positions):
        for position in positions:
            del self.used[position]
            self.root = None if self.root == position else self.root
            self.pinned = None if self.pinned == position else self.pinned


def check_invariants(retention: Retention, oracle: Oracle, evicted: list[int], root_at_eviction) -> None:
    positions = retention.positions
    assert positions == sorted(set(positions)) and all(p >= 1 for p in positions)
    assert positions == sorted(oracle.used)
    assert (retention.root, retention.pinned) == (oracle.root, oracle.pinned)
    if len(positions) > retention.config.cap:  # only a pin holds it over the cap
        assert positions[:-1] == [retention.pinned]
    assert not set(evicted) & set(positions)
    if retention.config.cap >= 2 and root_at_eviction in evicted:  # the root went: nothing else could
        assert set(positions[:-1]) <= {retention.pinned}


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_keep_the_invariants(seed):
    rng = random.Random(seed)
    cap, policy = rng.randint(1, 7), rng.choice(["lru", "spread"])
    retention, oracle = Retention(RetentionConfig(cap=cap, policy=policy)), Oracle(cap, policy)
    for _ in range(300):
        newest = retention.positions[-1] if retention.positions else 0
        kind, evicted, root_at_eviction = rng.random(), [], retention.root
        if kind < 0.55 or not retention.positions:  # the end of a turn, sometimes the root or a pin
            position = newest + rng.randint(1, 2000) if rng.random() < 0.85 else rng.randint(1, newest + 1)
            root, pinned = rng.random() < 0.05, rng.random() < 0.05
            root_at_eviction = position if root else root_at_eviction  # a new root makes the old one ordinary
            evicted = retention.add(position, root=root, pinned=pinned)
            oracle.touch(position)
            oracle.root = position if root else oracle.root
            oracle.pinned = position if pinned else oracle.pinned
            assert evicted == oracle.evict()
            assert retention.positions[-1] == max(newest, position) and not (pinned and position in evicted)
        elif kind < 0.75:
            position = rng.choice(retention.positions)
            retention.mount(position)
            oracle.touch(position)
        elif kind < 0.85:
            position = rng.choice(retention.positions)
            pin_evicted = retention.pin(position)
            oracle.pinned = position
            assert pin_evicted == oracle.evict()
            evicted = pin_evicted
        else:
            common = rng.randint(0, newest)
            dropped = retention.drop_after(common)
            assert dropped == sorted(p for p in oracle.used if p > common)
            oracle.forget(dropped)
        check_invariants(retention, oracle, evicted, root_at_eviction)
