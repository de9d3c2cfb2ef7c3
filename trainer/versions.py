"""Which policy version sampled which token, from what the envs record.

A trajectory says it per assistant turn (``turn_policy_versions``: the oldest version of
the turn's tokens) and, for a turn that ran across an in-flight weight update
(``sync_pause: keep``), per run of tokens (``metadata["turns"][k]["version_spans"]``:
``[start, end, version]``, see docs/data-contract.md). Tokens with no recorded version
are ``None``.

The step-0 alignment check compares the trainer's logprobs with vLLM's only on the tokens
the trainer's own weights sampled (:func:`only_version`): tokens of another version were
sampled by other weights and differ by design (they are what the importance ratio
corrects).
"""

from __future__ import annotations

from dataclasses import replace

from environments.trajectory import MASKED, ScoredTrajectory
from trainer.sources import Batch


def token_versions(trajectory: ScoredTrajectory) -> list[int | None]:
    """The policy version of every token of ``trajectory`` (None: not recorded, or not an
    assistant turn's)."""
    versions: list[int | None] = [None] * len(trajectory.tokens)
    turns = (trajectory.metadata or {}).get("turns")
    for k, (start, end) in enumerate(trajectory.turn_spans or []):
        version = trajectory.turn_policy_versions[k] \
            if trajectory.turn_policy_versions is not None else trajectory.policy_version
        versions[start:end] = [version] * (end - start)
        record = turns[k] if isinstance(turns, list) and k < len(turns) else None
        spans = record.get("version_spans") if isinstance(record, dict) else None
        for s, e, v in spans or []:
            versions[s:e] = [v] * (e - s)
    if not trajectory.turn_spans and trajectory.policy_version is not None:
        versions = [trajectory.policy_version] * len(trajectory.tokens)
    return versions


def only_version(batch: Batch, version: int) -> Batch | None:
    """``batch`` with the tokens that another policy version sampled masked out (not
    trained, not compared); tokens with no recorded version count as ``version``'s.
    None when no token of ``batch`` is another version's (use it as it is)."""
    changed = False
    groups = []
    for group in batch.groups:
        trajectories = []
        for t in group.trajectories:
            versions = token_versions(t)
            if all(v is None or v == version for v in versions):
                trajectories.append(t)
                continue
            changed = True
            trajectories.append(t.model_copy(update={"masks": [
                m if v is None or v == version else MASKED
                for m, v in zip(t.masks, versions)]}))
        groups.append(group.model_copy(update={"trajectories": trajectories}))
    if not changed:
        return None
    return replace(batch, groups=groups, rejected=[], stats={})
