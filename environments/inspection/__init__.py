"""Looking at scored trajectories: ``lachesis inspect`` (terminal) and ``lachesis report`` (HTML).

* :mod:`.data`: pure data preparation (streaming reads with line numbers, filters,
  statistics, per-turn and per-token rows, the report's sample of groups);
* :mod:`.terminal`: the ``rich`` rendering of ``lachesis inspect``;
* :mod:`.html_report`: the self-contained HTML report of ``lachesis report``.
"""

from environments.inspection.data import (
    Filter,
    Stats,
    TokenDecoder,
    TokenRow,
    TurnRow,
    compute_stats,
    token_rows,
    turn_rows,
)
from environments.inspection.html_report import write_report

__all__ = ["Filter", "Stats", "TokenDecoder", "TokenRow", "TurnRow", "compute_stats",
           "token_rows", "turn_rows", "write_report"]
