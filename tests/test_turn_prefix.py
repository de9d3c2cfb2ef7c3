"""``samples: turn_prefix``: one training row per assistant turn (issue 9), on tensors and
a tiny randomly initialised Qwen2 (no vLLM)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from environments.trajectory import MASKED, ScoredGroup, ScoredTrajectory
from trainer.advantages import ESTIMATORS, compute_group_advantages
from trainer.batch import BatchError, Sample, pack, turn_prefix_samples
from trainer.config import TrainConfig
from trainer.train import Batch, batch_tensors, train_step

M = MASKED

# prompt [0, 3) · turn 0 [3, 5) · tool result [5, 7) · turn 1 [7, 10) · tool [10, 11) ·
# turn 2 [11, 13)
TOKENS = [1, 2, 3, 10, 11, 4, 5, 20, 21, 22, 6, 30, 31]
MASKS = [M, M, M, 10, 11, M, M, 20, 21, 22, M, 30, 31]
LOGPROBS = [1.0, 1.0, 1.0, -0.1, -0.2, 1.0, 1.0, -0.3, -0.4, -0.5, 1.0, -0.6, -0.7]
SPANS = [[3, 5], [7, 10], [11, 13]]


def three_turns() -> ScoredTrajectory:
    return ScoredTrajectory(tokens=TOKENS, masks=MASKS, inference_logprobs=LOGPROBS,
                            scores=[0.5, 1.0, 1.0], turn_spans=SPANS)


def test_prefix_expansion_equals_hand_built_samples_for_three_turns():
    advantages = np.array([0, 0, 0, .7, .7, 0, 0, -.3, -.3, -.3, 0, 1.2, 1.2], np.float32)
    rows, row_advantages = turn_prefix_samples(three_turns(), advantages)
    assert rows == [
        Sample([1, 2, 3, 10, 11], [M, M, M, 10, 11], [1.0, 1.0, 1.0, -0.1, -0.2], 0),
        Sample([1, 2, 3, 10, 11, 4, 5, 20, 21, 22], [M, M, M, M, M, M, M, 20, 21, 22],
               [1.0, 1.0, 1.0, -0.1, -0.2, 1.0, 1.0, -0.3, -0.4, -0.5], 1),
        Sample(TOKENS, [M] * 11 + [30, 31], LOGPROBS, 2),
    ]
    expected = [[0, 0, 0, .7, .7],
                [0, 0, 0, 0, 0, 0, 0, -.3, -.3, -.3],
                [0] * 11 + [1.2, 1.2]]
    for got, want in zip(row_advantages, expected):
        np.testing.assert_array_equal(got, np.array(want, np.float32))
    # packed: one row per turn, the trained positions of turn k only, its advantage there
    batch = pack(rows, row_advantages)
    assert batch.tokens.shape == (3, 13) and batch.lengths.tolist() == [5, 10, 13]
    assert batch.mask.nonzero().tolist() == [[0, 3], [0, 4], [1, 7], [1, 8], [1, 9],
                                             [2, 11], [2, 12]]
    assert batch.advantages[batch.mask].tolist() == pytest.approx([.7, .7, -.3, -.3, -.3,
                                                                   1.2, 1.2])
    assert batch.old_logprobs[batch.mask].tolist() == pytest.approx(
        [-.1, -.2, -.3, -.4, -.5, -.6, -.7])


def test_rows_without_spans_untrained_turns_and_tokens_outside_spans():
    whole = ScoredTrajectory(tokens=[1, 2, 3], masks=[M, 2, 3], inference_logprobs=[1, -1, -1],
                             scores=1.0)
    rows, advantages = turn_prefix_samples(whole, np.ones(3))
    assert rows == [Sample([1, 2, 3], [M, 2, 3], [1, -1, -1], 0)] and len(advantages) == 1
    # a turn with no trained token (not sampled by the policy) gives no row
    untrained = three_turns().model_copy(update={"masks": MASKS[:7] + [M, M, M] + MASKS[10:]})
    rows, _ = turn_prefix_samples(untrained, np.zeros(13))
    assert [r.turn for r in rows] == [0, 2]
    stray = three_turns().model_copy(update={"masks": MASKS[:5] + [4] + MASKS[6:]})
    with pytest.raises(BatchError, match="group 0 sequence 1: token 5 is trained but outside"):
        turn_prefix_samples(stray, np.zeros(13), "group 0 sequence 1")


def trajectory(rng: random.Random, n_turns: int, scores: list[float]) -> ScoredTrajectory:
    """Prompt, then n_turns assistant turns separated by tool results; random tokens."""
    tokens, masks, logprobs, spans = [], [], [], []

    def add(n: int, trained: bool) -> None:
        for _ in range(n):
            token = rng.randrange(1, 64)
            tokens.append(token)
            masks.append(token if trained else M)
            logprobs.append(-rng.uniform(0.5, 4.0) if trained else 1.0)

    add(rng.randrange(4, 8), False)
    for k in range(n_turns):
        if k:
            add(rng.randrange(2, 4), False)
        start = len(tokens)
        add(rng.randrange(2, 6), True)
        spans.append([start, len(tokens)])
    return ScoredTrajectory(tokens=tokens, masks=masks, inference_logprobs=logprobs,
                            scores=scores, turn_spans=spans,
                            metadata={"metrics": {"reward/called_tool": float(n_turns > 1)}})


def groups(seed: int = 0) -> list[ScoredGroup]:
    rng = random.Random(seed)
    return [
        ScoredGroup(trajectories=[trajectory(rng, 3, [1.0, 0.5, 1.0]),
                                  trajectory(rng, 2, [0.0, 0.2]),
                                  trajectory(rng, 1, [0.8]),
                                  trajectory(rng, 3, [0.5, 0.0, 0.0])]),
        ScoredGroup(trajectories=[trajectory(rng, 2, [1.0, 1.0]),
                                  trajectory(rng, 2, [0.5, 0.0])]),
    ]


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_turn_prefix_rows_carry_each_turns_advantage_under_every_estimator(estimator):
    batch = Batch(groups())
    sequence, stats = batch_tensors(batch, TrainConfig(model="m", estimator=estimator),
                                    vocab_size=64, pad_id=0)
    prefix, prefix_stats = batch_tensors(
        batch, TrainConfig(model="m", estimator=estimator, samples="turn_prefix"),
        vocab_size=64, pad_id=0)
    trajectories = [t for g in batch.groups for t in g.trajectories]
    assert (stats["rows"], prefix_stats["rows"]) == (6, 13)  # 6 trajectories, 13 turns
    assert stats["row_tokens"] == sum(len(t.tokens) for t in trajectories)
    assert prefix_stats["row_tokens"] == sum(e for t in trajectories for _, e in t.turn_spans)
    assert prefix_stats["env/reward/called_tool"] == pytest.approx(5 / 6)
    row = 0
    for i, t in enumerate(trajectories):
        for k, (start, end) in enumerate(t.turn_spans):
            # row `row` is trajectory i up to the end of turn k, trained on turn k only
            assert prefix.lengths[row] == end
            assert prefix.tokens[row, :end].tolist() == t.tokens[:end]
            assert prefix.mask[row].nonzero().flatten().tolist() == list(range(start, end))
            # ... with the estimator's advantage of turn k: one scalar per row
            want = sequence.advantages[i, start:end]
            assert torch.equal(prefix.advantages[row, start:end], want)
            assert torch.all(want == want[0])
            row += 1
    # the same trained tokens, each once, with the same advantage and behaviour logprob
    assert prefix.n_tokens == sequence.n_tokens
    assert sorted(prefix.advantages[prefix.mask].tolist()) == \
        sorted(sequence.advantages[sequence.mask].tolist())


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config).float()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_turn_prefix_gradient_equals_sequence_gradient_under_token_mean(aggregation):
    """Causal attention: a turn-k token's logprob is the same in its prefix row as in the
    whole trajectory, so under token_mean the step is the same (different micro-batches
    and padding, same sum); under sequence_mean each turn weighs as a sequence."""
    batch = Batch(groups())
    model = tiny_qwen2()
    params = {}
    for samples in ("sequence", "turn_prefix"):
        config = TrainConfig(model="m", estimator="mt_grpo", samples=samples,
                             micro_batch_size=3, max_grad_norm=None, aggregation=aggregation)
        tensors, _ = batch_tensors(batch, config, vocab_size=64, pad_id=0)
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=1.0)
        metrics = train_step(trained, optimizer, tensors, config)
        params[samples] = torch.cat([p.detach().flatten() for p in trained.parameters()])
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert metrics["trained_tokens"] == tensors.n_tokens
    moved = float((params["sequence"] - start).abs().max())  # ~0.09 (SGD, lr 1)
    difference = float((params["sequence"] - params["turn_prefix"]).abs().max())
    assert moved > 1e-2
    if aggregation == "token_mean":
        assert difference < 1e-6  # float rounding (measured ~3e-8)
    else:
        assert difference > 0.05 * moved  # (measured ~0.02 of ~0.07)


def test_turn_prefix_composes_with_env_advantages():
    group = groups()[1]
    override = [0.0] * len(group.trajectories[0].tokens)
    start, end = group.trajectories[0].turn_spans[1]
    override[start:end] = [float(x) for x in range(end - start)]  # varies inside the turn
    group.trajectories[0] = group.trajectories[0].model_copy(update={"advantages": override})
    result = compute_group_advantages(group.trajectories, "grpo")
    rows, row_advantages = turn_prefix_samples(group.trajectories[0], result.advantages[0])
    assert [r.turn for r in rows] == [0, 1]
    np.testing.assert_array_equal(row_advantages[1][start:end], np.arange(end - start))
    assert not row_advantages[0].any()
