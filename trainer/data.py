"""A byte-level language-modelling task over a deterministically generated corpus.

The corpus is English-like text from a small grammar: words, sentences and paragraphs
drawn from fixed word lists with a seeded RNG. It has real structure (spelling, word order,
punctuation), so a byte-level model's loss falls well below the uniform ln(256) = 5.55
nats, and it needs no download.
"""

from __future__ import annotations

import random

import torch

_SUBJECTS = "the cluster|every rank|the optimizer|a slow node|the collector|our model|the loss"
_VERBS = "watches|measures|reduces|gathers|flags|reports|trains|shards|replays|counts"
_OBJECTS = (
    "the gradient norm|each layer|the step time|a loss spike|the power draw|every token"
    "|the learning rate|a straggler|the activations|silent corruption"
)
_ADVERBS = "quickly|again|twice|at night|before dawn|without waiting|in order|on time"
_SUBJECTS, _VERBS, _OBJECTS, _ADVERBS = (
    w.split("|") for w in (_SUBJECTS, _VERBS, _OBJECTS, _ADVERBS)
)


def generate_corpus(n_bytes: int, seed: int = 0) -> bytes:
    """Deterministic English-like text of at least `n_bytes` bytes."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            sentence += f" {rng.choice(_ADVERBS)}"
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "!", "?"])
        sentence += "\n" if rng.random() < 0.15 else " "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts).encode("ascii")


class ByteBatches:
    """Random windows of the corpus; every rank draws the same global batch and keeps its slice.

    Drawing the global batch everywhere (cheap: indices only) and slicing by data-parallel
    rank makes a run with dp ranks see exactly the data of a single-process run with the
    same seed and global batch, which is what the hooks' exactness test relies on.
    """

    def __init__(self, corpus: bytes, seq_len: int, global_batch: int, seed: int) -> None:
        if len(corpus) <= seq_len + 1:
            raise ValueError(f"corpus of {len(corpus)} bytes is too short for seq_len {seq_len}")
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.gen = torch.Generator().manual_seed(seed)
        self.drawn = 0  # global batches drawn so far: the next one's data index

    def _starts(self) -> torch.Tensor:
        self.drawn += 1
        return torch.randint(
            0, len(self.data) - self.seq_len - 1, (self.global_batch,), generator=self.gen
        )

    def skip(self, n_batches: int) -> None:
        """Draw and drop n batches: a resumed run sees the data an unbroken one would."""
        for _ in range(n_batches):
            self._starts()

    def next(self, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (global_batch / dp, seq_len) for this data-parallel rank."""
        if self.global_batch % dp:
            raise ValueError(f"global batch {self.global_batch} is not divisible by dp={dp}")
        local = self._starts().view(dp, -1)[dp_rank]
        offsets = torch.arange(self.seq_len + 1)
        windows = self.data[local[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


def parse_windows(specs: list[str]) -> set[int]:
    """'30:37' (data windows 30 to 37, inclusive), repeatable -> the set of skipped indices."""
    skipped: set[int] = set()
    for spec in specs:
        first, colon, last = spec.partition(":")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            lo, hi = -1, -1
        if lo < 0 or hi < lo or (colon and not last):
            raise ValueError(
                f"--skip-data {spec!r}: expected FIRST:LAST, whole numbers, FIRST <= LAST"
            )
        skipped.update(range(lo, hi + 1))
    return skipped


def data_index(step: int, skipped: set[int]) -> int:
    """The data window step `step` trains on when the windows in `skipped` are left out:
    the step-th window not skipped."""
    index = step
    for s in sorted(skipped):  # each skipped window at or before it pushes it one on
        if s <= index:
            index += 1
    return index


def advance_to(batches: ByteBatches, index: int) -> None:
    """Draw and drop batches until the next one drawn is the data window `index`."""
    if index < batches.drawn:
        raise ValueError(f"data window {index} was drawn already ({batches.drawn} drawn)")
    batches.skip(index - batches.drawn)
