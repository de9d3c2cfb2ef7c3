"""Where an env server is in its item order, kept on disk, so that a restarted server
continues it: the items whose groups were delivered (or failed) are not drawn again, and
the items that were in flight when it died are sampled again.

The env's item order is whatever ``get_next_item`` yields (seeded by the env's
settings). The cursor records ``settled``: every item index below it was delivered or
given up, and the indices above it that were settled out of order. A restarted server
draws (and discards) the first ``settled`` items, so its ``get_next_item`` (and the
random state behind it) is exactly where it was, then skips the items settled out of
order: what is drawn next is what was in flight, then new items.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class ItemCursor:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else None
        self.drawn = 0
        """Items drawn from the env so far (the index of the next)."""
        self.settled = 0
        self.settled_above: set[int] = set()
        if self.path is not None and self.path.exists():
            state = json.loads(self.path.read_text())
            self.settled = int(state["settled"])
            self.settled_above = {int(i) for i in state["settled_above"]}
        self._replay_to = self.settled

    @property
    def resumed(self) -> int:
        """Items settled by earlier starts of this server (skipped on this one)."""
        return self._replay_to + len(self.settled_above)

    async def next(self, env: Any) -> tuple[int, Any]:
        """The next item to sample, and its index in the env's item order."""
        while self.drawn < self._replay_to:  # where the previous start had got to
            await env.get_next_item()
            self.drawn += 1
        while True:
            index = self.drawn
            self.drawn += 1
            try:
                item = await env.get_next_item()
            except BaseException:
                self.settle(index)  # nothing to sample again
                raise
            if index not in self.settled_above or index < self.settled:
                return index, item

    def settle(self, index: int) -> None:
        """The group of item ``index`` was delivered (or given up)."""
        self.settled_above.add(index)
        while self.settled in self.settled_above:
            self.settled_above.discard(self.settled)
            self.settled += 1
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({"settled": self.settled,
                                       "settled_above": sorted(self.settled_above)}))
            os.replace(tmp, self.path)
