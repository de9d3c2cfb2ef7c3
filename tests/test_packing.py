"""Padding-free packing, chunked logprobs and activation checkpointing change nothing a
user trains on: logprobs, loss and gradients equal the padded full-logits path (float32,
CPU, tiny random Qwen2), for whole sequences, segments and turn-prefix rows."""

from __future__ import annotations

import copy

import pytest
import torch
from test_segments import group as segmented_group
from test_turn_prefix import groups, tiny_qwen2

from trainer.batch import plan_micro_batches
from trainer.config import TrainConfig
from trainer.logprobs import VARLEN_SDPA
from trainer.losses import chunked_token_logprobs
from trainer.train import (
    Batch,
    batch_tensors,
    micro_batches,
    sequence_logprobs,
    train_step,
)

PADDED = {"packing": False, "micro_batch_size": 3, "logprob_chunk_size": None}
PACKED = {"packing": True, "max_tokens_per_micro_batch": 40, "logprob_chunk_size": 5}


def model(attention: str = VARLEN_SDPA):
    m = tiny_qwen2()
    m.config._attn_implementation = attention
    return m


def tensors(samples: str, aggregation: str = "token_mean", **settings):
    """Rows of 7 trajectories (one of them with two segments), as the trainer builds them."""
    config = TrainConfig(model="m", estimator="mt_grpo", samples=samples, max_grad_norm=None,
                         aggregation=aggregation, **settings)
    batch, _ = batch_tensors(Batch([*groups(), segmented_group()]), config, vocab_size=64,
                             pad_id=0)
    return batch, config


def test_plan_fills_a_token_budget_first_fit_decreasing_every_row_once():
    assert plan_micro_batches([5, 3, 8, 2], max_tokens=8) == [[2], [0, 1], [3]]
    assert plan_micro_batches([9, 1], max_tokens=8) == [[0], [1]]  # too long: alone
    assert plan_micro_batches([1, 2, 3], max_rows=2) == [[0, 1], [2]]


@pytest.mark.parametrize("attention", [VARLEN_SDPA, "sdpa", "eager"])
@pytest.mark.parametrize("samples", ["sequence", "turn_prefix"])
def test_packed_and_chunked_logprobs_equal_the_padded_ones(samples, attention):
    batch, _ = tensors(samples)
    lm = model(attention).eval()
    with torch.no_grad():
        padded = sequence_logprobs(lm, batch.tokens, batch.lengths)
        for packing, chunk in [(True, None), (False, 3), (True, 3)]:
            got = sequence_logprobs(lm, batch.tokens, batch.lengths, packing=packing,
                                    chunk_size=chunk, where=batch.mask)
            torch.testing.assert_close(got[batch.mask], padded[batch.mask], rtol=0, atol=1e-5)
            assert (got[~batch.mask] == 0).all()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("samples", ["sequence", "turn_prefix"])
def test_packed_chunked_step_has_the_padded_loss_and_gradient(samples, aggregation):
    """One SGD step (lr 1: the parameter change is the gradient) over several packed
    micro-batches equals the padded full-logits step; the micro-batches differ."""
    start = model()
    results = {}
    for name, settings in [("padded", PADDED), ("packed", PACKED),
                           ("packed_ckpt", {**PACKED, "activation_checkpointing": True})]:
        batch, config = tensors(samples, aggregation, **settings)
        trained = copy.deepcopy(start)
        if not config.packing:  # the path before packing: SDPA with a padding mask
            trained.config._attn_implementation = "sdpa"
        if config.activation_checkpointing:
            trained.gradient_checkpointing_enable({"use_reentrant": False})
        optimizer = torch.optim.SGD(trained.parameters(), lr=1.0)
        metrics = train_step(trained, optimizer, batch, config)
        gradient = [(a - b).detach() for a, b in zip(start.parameters(), trained.parameters())]
        results[name] = metrics["loss"], gradient, micro_batches(batch, config)
    loss, gradient, plan = results["padded"]
    assert len(results["packed"][2]) > 1 and results["packed"][2] != plan
    assert max(float(g.abs().max()) for g in gradient) > 1e-2
    for name in ("packed", "packed_ckpt"):
        assert results[name][0] == pytest.approx(loss, abs=1e-5)
        for a, b in zip(results[name][1], gradient):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # activation checkpointing recomputes the same values: the same gradient, bit for bit
    # up to float summation order
    for a, b in zip(results["packed_ckpt"][1], results["packed"][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_chunked_logprobs_and_gradients_equal_the_full_computation():
    torch.manual_seed(0)
    n, h, v = 23, 16, 50
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    upstream = torch.randn(n, dtype=torch.float64)  # per-token weights, as a loss gives

    full = torch.log_softmax(hidden @ weight.T + bias, -1).gather(1, targets[:, None])[:, 0]
    want = torch.autograd.grad((full * upstream).sum(), (hidden, weight, bias))
    for chunk in (1, 7, 23, 64):
        got = chunked_token_logprobs(hidden, weight, targets, chunk_size=chunk, bias=bias)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, full.float(), rtol=0, atol=1e-5)
        grads = torch.autograd.grad((got * upstream.float()).sum(), (hidden, weight, bias))
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(hidden, weight, targets, chunk_size=0)


def test_the_rehearsal_runs_the_longest_micro_batch_and_leaves_everything_as_it_was():
    """``rehearse_longest_micro_batch``: one forward and backward of the largest
    micro-batch the config can build (packed: rows of max_token_length up to the budget,
    no more than the batch holds; padded: micro_batch_size rows), and nothing a user
    trains on changes: the weights, the gradients (none), the random stream."""
    from trainer.rehearsal import longest_micro_batch, rehearse

    packed = TrainConfig(model="m", batch_size=8, max_token_length=24, logprob_chunk_size=5,
                         max_tokens_per_micro_batch=60)
    assert longest_micro_batch(packed) == [24, 24, 12]
    assert longest_micro_batch(packed.model_copy(update={"batch_size": 2})) == [24, 24]
    assert longest_micro_batch(packed.model_copy(update={"batch_size": 2,
                                                         "samples": "turn_prefix"})) == [24, 24, 12]
    assert longest_micro_batch(packed.model_copy(update={"max_tokens_per_micro_batch": 16})) \
        == [24]  # a row longer than the budget is a micro-batch alone
    padded = packed.model_copy(update={"packing": False, "micro_batch_size": 3})
    assert longest_micro_batch(padded) == [24, 24, 24]
    for config, attention, seen in [(packed, VARLEN_SDPA, [(1, 60)]),
                                    (padded, "sdpa", [(3, 24)])]:
        lm = model(attention)
        before = copy.deepcopy(lm.state_dict())
        shapes = []
        lm.model.embed_tokens.register_forward_hook(
            lambda module, args, out: shapes.append(tuple(args[0].shape)))
        backward = []
        lm.lm_head.weight.register_hook(lambda grad: backward.append(float(grad.abs().sum())))
        rng = torch.get_rng_state()
        found = rehearse(lm, config, vocab_size=64, pad_id=0)
        assert shapes == seen and len(backward) == 1 and backward[0] > 0  # one forward, backward
        assert (found["rows"], found["tokens"]) == (len(longest_micro_batch(config)),
                                                    sum(longest_micro_batch(config)))
        assert all(p.grad is None for p in lm.parameters())
        assert all(torch.equal(v, lm.state_dict()[k]) for k, v in before.items())
        assert torch.equal(torch.get_rng_state(), rng)
