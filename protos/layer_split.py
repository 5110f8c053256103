"""A model's layers split into stages, pure (the executor, the planner and the CLI share it): the range a stage holds, and the ranges of a split asked for by a
stage count (even) or by cut points (`10,20`)."""

from __future__ import annotations

from dataclasses import dataclass

EXIT_GROUP_LOST = 3  # the exit status of a stage whose group is lost (another stage's end, not its own fault)


@dataclass(frozen=True, slots=True)
class LayerRange:
    """Layers [begin, end) of a model of num_layers: the first stage also holds the embedding, the last the
    final norm, the head and the sampler. The whole model is the range [0, num_layers)."""

    begin: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.begin < self.end <= self.num_layers:
            raise ValueError(
                f"layers {self.begin}:{self.end} are not a non-empty range of the model's {self.num_layers}"
            )

    @classmethod
    def whole(cls, num_layers: int) -> LayerRange:
        return cls(0, num_layers, num_layers)

    @property
    def first(self) -> bool:
        return self.begin == 0

    @property
    def last(self) -> bool:
        return self.end == self.num_layers

    @property
    def count(self) -> int:
        return self.end - self.begin

    def holds_embedding(self, tied_head: bool) -> bool:
        """Whether the stage holds the embedding: the first stage's input, and the last's head where tied."""
        return self.first or (self.last and tied_head)

    def holds_head(self, tied_head: bool) -> bool:
        """Whether the stage holds a head of its own (a tied head is the embedding)."""
        return self.last and not tied_head


def parse_layers(text: str) -> tuple[int, int]:
    """`A:B` -> (A, B), 0 <= A < B; the model's layer count is checked once it is loaded."""
    begin, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        a, b = int(begin), int(end)
    except ValueError:
        raise ValueError(f"layers must be A:B (the stage holds layers A to B-1), got {text!r}") from None
    if not 0 <= a < b:
        raise ValueError(f"layers {text!r}: need 0 <= A < B")
    return a, b


def split_layers(num_layers: int, split: str) -> list[tuple[int, int]]:
    """The stages' ranges: `N` splits evenly (the first stages one layer more where it does not divide),
    `C1,C2,...` cuts at those layers (ascending, inside the model)."""
    parts = [p.strip() for p in split.split(",")]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"a layer split is N stages or cut points like 10,20; got {split!r}") from None
    if len(numbers) == 1:
        (stages,) = numbers
        if not 1 <= stages <= num_layers:
            raise ValueError(f"{stages} stages for {num_layers} layers: need 1 to {num_layers}")
        size, extra = divmod(num_layers, stages)
        bounds = [0]
        for stage in range(stages):
            bounds.append(bounds[-1] + size + (stage < extra))
    else:
        if any(a >= b for a, b in zip([0, *numbers], numbers)) or numbers[-1] >= num_layers:
            raise ValueError(
                f"cut points {split!r} must ascend strictly inside the model's layers (1 to {num_layers - 1})"
            )
        bounds = [0, *numbers, num_layers]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def check_stages(ranges: list[tuple[int, int]], num_layers: int) -> None:
    """The stages of a group, in rank order, hold [0, num_layers) once each, contiguously; ValueError
    naming the first gap or overlap otherwise."""
    edge = 0
    for rank, (begin, end) in enumerate(ranges):
        if begin != edge or end <= begin:
            raise ValueError(f"stage {rank} holds layers {begin}:{end}; expected it to start at {edge}")
        edge = end
    if edge != num_layers:
        raise ValueError(f"the stages hold layers 0:{edge} of the model's {num_layers}")
