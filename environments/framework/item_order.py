"""Walk a list of items epoch by epoch, for an env's ``get_next_item``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


class EpochOrder:
    """Every item once per epoch before any repeats, in a new order each epoch
    (``rng``-shuffled) or, with ``shuffle=False``, in list order."""

    def __init__(self, rng: random.Random, shuffle: bool = True):
        self.rng = rng
        self.shuffle = shuffle
        self._order: list[int] = []
        self._position = 0

    def next(self, items: Sequence[Any]) -> Any:
        if self._position >= len(self._order):
            self._order = list(range(len(items)))
            if self.shuffle:
                self.rng.shuffle(self._order)
            self._position = 0
        item = items[self._order[self._position]]
        self._position += 1
        return item
