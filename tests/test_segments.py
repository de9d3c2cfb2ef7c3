"""Trajectories with ``segment_starts`` (several independent contexts): advantages on the
whole trajectory, one training row per segment, and the rows really are separate contexts
(on a tiny randomly initialised Qwen2, no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_turn_prefix import tiny_qwen2

from environments.trajectory import MASKED, ScoredGroup, ScoredTrajectory
from trainer.advantages import compute_group_advantages
from trainer.batch import BatchError, Sample, segment_samples, turn_prefix_samples
from trainer.config import TrainConfig
from trainer.train import Batch, alignment_check, batch_tensors, sequence_logprobs

M = MASKED

# segment 0: prompt [0, 3) · turn 0 [3, 5) · tool result [5, 6) · turn 1 [6, 8)
# segment 1: a rebuilt prompt [8, 11) · turn 2 [11, 14)
TOKENS = [1, 2, 3, 10, 11, 4, 20, 21, 5, 6, 7, 30, 31, 32]
MASKS = [M, M, M, 10, 11, M, 20, 21, M, M, M, 30, 31, 32]
LOGPROBS = [1.0, 1.0, 1.0, -.1, -.2, 1.0, -.3, -.4, 1.0, 1.0, 1.0, -.5, -.6, -.7]
SPANS = [[3, 5], [6, 8], [11, 14]]


def two_segments(**changes) -> ScoredTrajectory:
    return ScoredTrajectory(**{"tokens": TOKENS, "masks": MASKS, "inference_logprobs": LOGPROBS,
                               "scores": [0.5, 0.0, 1.0], "turn_spans": SPANS,
                               "segment_starts": [8], **changes})


def group() -> ScoredGroup:
    """The segmented trajectory and a plain one-context member."""
    plain = ScoredTrajectory(tokens=[1, 2, 3, 10, 11], masks=[M, M, M, 10, 11],
                             inference_logprobs=[1.0, 1.0, 1.0, -.1, -.2], scores=[0.0],
                             turn_spans=[[3, 5]])
    return ScoredGroup(trajectories=[two_segments(), plain])


def test_one_row_per_segment_equal_to_the_slices_with_whole_trajectory_advantages():
    advantages = np.arange(14, dtype=np.float32)
    rows, row_advantages = segment_samples(two_segments(), advantages)
    assert rows == [Sample(TOKENS[:8], MASKS[:8], LOGPROBS[:8], start=0, segment=0),
                    Sample(TOKENS[8:], MASKS[8:], LOGPROBS[8:], start=8, segment=1)]
    np.testing.assert_array_equal(row_advantages[0], advantages[:8])
    np.testing.assert_array_equal(row_advantages[1], advantages[8:])

    # in batch_tensors: the estimator sees the whole trajectory (3 turns, outcome 1.0),
    # then the segmented member gives 2 rows and the plain one 1
    config = TrainConfig(model="m", estimator="mt_grpo")
    whole = compute_group_advantages(group().trajectories, "mt_grpo").advantages[0]
    tensors, stats = batch_tensors(Batch([group()]), config, vocab_size=64, pad_id=0)
    assert stats["rows"] == 3 and tensors.lengths.tolist() == [8, 6, 5]
    assert tensors.tokens[0, :8].tolist() == TOKENS[:8]
    assert tensors.tokens[1, :6].tolist() == TOKENS[8:]
    assert tensors.mask[1, :6].tolist() == [m != M for m in MASKS[8:]]
    assert tensors.old_logprobs[1, 3:6].tolist() == pytest.approx([-.5, -.6, -.7])
    assert tensors.advantages[0, :8].tolist() == pytest.approx(
        np.where(np.array(MASKS[:8]) != M, whole[:8], 0).tolist())
    assert tensors.advantages[1, :6].tolist() == pytest.approx(
        np.where(np.array(MASKS[8:]) != M, whole[8:], 0).tolist())


def test_turn_prefix_expands_within_each_segment():
    advantages = np.array([0, 0, 0, .7, .7, 0, -.3, -.3, 0, 0, 0, 1.2, 1.2, 1.2], np.float32)
    rows, row_advantages = turn_prefix_samples(two_segments(), advantages)
    assert rows == [
        Sample(TOKENS[:5], MASKS[:5], LOGPROBS[:5], 0),
        Sample(TOKENS[:8], [M] * 6 + [20, 21], LOGPROBS[:8], 1),
        Sample(TOKENS[8:], MASKS[8:], LOGPROBS[8:], 2, start=8, segment=1),
    ]
    expected = [[0, 0, 0, .7, .7], [0] * 6 + [-.3, -.3], [0, 0, 0, 1.2, 1.2, 1.2]]
    for got, want in zip(row_advantages, expected):
        np.testing.assert_array_equal(got, np.array(want, np.float32))
    # a trained token outside every span is refused, in whole-trajectory coordinates
    stray = two_segments(scores=[0.5, 1.0], turn_spans=SPANS[:2])
    with pytest.raises(BatchError, match="sequence 0: token 11 is trained but outside"):
        turn_prefix_samples(stray, advantages, "sequence 0")


def test_segment_rows_are_independent_contexts_for_the_model():
    """A model's logprobs on segment 1's row are those of segment 1's tokens alone, not
    those it would give them after segment 0; so vLLM logprobs recorded per context pass
    the alignment check, which reads the packed rows."""
    model = tiny_qwen2().eval()

    def logprobs(tokens: list[int]) -> list[float]:
        with torch.no_grad():
            return sequence_logprobs(model, torch.tensor([tokens]),
                                     torch.tensor([len(tokens)]))[0].tolist()

    alone = logprobs(TOKENS[8:])
    joined = logprobs(TOKENS)[8:]
    assert max(abs(a - b) for a, b in zip(alone[1:], joined[1:])) > 1e-2  # context matters
    config = TrainConfig(model="m", estimator="mt_grpo")
    tensors, _ = batch_tensors(Batch([group()]), config, vocab_size=64, pad_id=0)
    with torch.no_grad():
        packed = sequence_logprobs(model, tensors.tokens, tensors.lengths)
    assert packed[1, :6].tolist() == pytest.approx(alone, abs=1e-5)
    assert packed[0, :8].tolist() == pytest.approx(logprobs(TOKENS[:8]), abs=1e-5)

    # behaviour logprobs as an inference server records them: each segment in its context
    recorded = [1.0 if m == M else lp
                for m, lp in zip(MASKS, logprobs(TOKENS[:8]) + alone)]
    recorded_group = group()
    recorded_group.trajectories[0] = two_segments(inference_logprobs=recorded)
    tensors, _ = batch_tensors(Batch([recorded_group]), config, vocab_size=64, pad_id=0)
    assert alignment_check(model, tensors.slice(slice(0, 2)), config)[0] < 1e-5
    # the same tokens read as one context would not align
    recorded_group.trajectories[0] = two_segments(inference_logprobs=recorded,
                                                  segment_starts=None)
    tensors, _ = batch_tensors(Batch([recorded_group]), config, vocab_size=64, pad_id=0)
    assert alignment_check(model, tensors.slice(slice(0, 1)), config)[0] > 1e-3
