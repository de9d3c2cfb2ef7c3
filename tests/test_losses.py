"""Losses against hand-computed cases; masked positions are never read and get no gradient.

ln 2 = 0.693147, ln 3 = 1.098612, ln 0.75 = -0.287682.
"""

import math

import pytest
import torch

from trainer.losses import policy_loss, sft_loss, token_logprobs

approx = lambda values: pytest.approx(values, rel=1e-5, abs=1e-6)  # noqa: E731


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# -- token_logprobs ----------------------------------------------------------------------

def test_token_logprobs_alignment():
    # logits[t] predicts tokens[t + 1]; out[t] = log p(tokens[t] | tokens[<t]); out[0] = 0.
    logits = t([[[0.0, math.log(3)],    # p = [1/4, 3/4] -> predicts tokens[1] = 1: ln 0.75
                 [0.0, 0.0],            # p = [1/2, 1/2] -> predicts tokens[2] = 0: ln 0.5
                 [5.0, -5.0]]])         # predicts nothing (past the end): unused
    logits.requires_grad_(True)
    tokens = torch.tensor([[1, 1, 0]])
    out = token_logprobs(logits, tokens)
    assert out.shape == (1, 3) and out.dtype == torch.float32
    assert out[0].tolist() == approx([0.0, -0.287682, -0.693147])
    out.sum().backward()
    assert logits.grad[0, 2].tolist() == [0.0, 0.0]


def test_token_logprobs_batched_with_padding_ids_and_bf16():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    tokens = torch.tensor([[3, 1, 4, 1, 5], [2, 6, -100, -100, -100]])  # -100: padding
    out = token_logprobs(logits.bfloat16(), tokens)
    assert out.dtype == torch.float32
    reference = torch.log_softmax(logits.bfloat16().float(), dim=-1)
    for b, length in ((0, 5), (1, 2)):
        for i in range(1, length):
            assert float(out[b, i]) == pytest.approx(float(reference[b, i - 1, tokens[b, i]]),
                                                     abs=1e-6)
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(logits, tokens[:, :4])


# -- the clipped surrogate ---------------------------------------------------------------

def test_clipped_surrogate_hand_computed():
    # ratio r = exp(logprobs - old); A = advantage; l = -min(r A, clip(r, 0.8, 1.2) A)
    #   r=1.1 A=+1: -min( 1.1,  1.1) = -1.1   inside the clip range
    #   r=1.5 A=+1: -min( 1.5,  1.2) = -1.2   clipped (no gradient)
    #   r=1.5 A=-1: -min(-1.5, -1.2) = +1.5   not clipped: the pessimistic term wins
    #   r=0.5 A=+1: -min( 0.5,  0.8) = -0.5   not clipped
    #   r=0.5 A=-1: -min(-0.5, -0.8) = +0.8   clipped (no gradient)
    #   r=1.1 A=-1: -min(-1.1, -1.1) = +1.1
    # token mean = (-1.1 - 1.2 + 1.5 - 0.5 + 0.8 + 1.1) / 6 = 0.6 / 6 = 0.1
    ratios = [1.1, 1.5, 1.5, 0.5, 0.5, 1.1]
    adv = t([[1.0, 1.0, -1.0, 1.0, -1.0, -1.0]])
    old = t([[-1.0] * 6])
    logprobs = (old + torch.log(t([ratios]))).requires_grad_(True)
    mask = torch.ones(1, 6, dtype=torch.bool)
    loss, metrics = policy_loss(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx(0.1, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 6)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 6, rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(1.5, rel=1e-6)
    assert metrics["tis_weight_mean"] == 1.0 and metrics["n_tokens"] == 6.0
    loss.backward()
    # d l / d logprob = -r A / 6 where not clipped (d r / d logprob = r), 0 where clipped
    assert logprobs.grad[0].tolist() == approx([-1.1 / 6, 0.0, 1.5 / 6, -0.5 / 6, 0.0, 1.1 / 6])


def test_asymmetric_clip_range():
    # clip_high = 0.28: r = 1.25 with A = +1 is inside [0.8, 1.28] -> -1.25, not clipped
    old, mask = t([[0.0]]), torch.ones(1, 1, dtype=torch.bool)
    loss, metrics = policy_loss(old + math.log(1.25), old, t([[1.0]]), mask, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25, rel=1e-6) and metrics["clip_fraction"] == 0.0


def test_approx_kl_to_behaviour():
    # r = 2: k3 = r - 1 - ln r = 2 - 1 - 0.693147 = 0.306853
    old, mask = t([[0.0]]), torch.ones(1, 1, dtype=torch.bool)
    _, metrics = policy_loss(old + math.log(2), old, t([[0.0]]), mask)
    assert metrics["approx_kl"] == pytest.approx(0.306853, rel=1e-5)


# -- truncated importance sampling -------------------------------------------------------

def test_tis_weight_is_capped_and_ratio_uses_trainer_logprobs():
    # Behaviour (vLLM) mu = 0; trainer's old logprobs p: p - mu = ln 3 and ln 0.5.
    # w = min(exp(p - mu), 2) = [min(3, 2), min(0.5, 2)] = [2, 0.5]
    # Current logprobs = p + ln 1.1: r = exp(logprobs - p) = 1.1 (inside the clip range,
    # though exp(logprobs - mu) = 3.3 and 0.55 would both be clipped).
    # l = -w * r * A with A = 1: [-2.2, -0.55]; token mean = -2.75 / 2 = -1.375
    mu = t([[0.0, 0.0]])
    p = t([[math.log(3), math.log(0.5)]])
    logprobs = (p + math.log(1.1)).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = policy_loss(logprobs, mu, t([[1.0, 1.0]]), mask, trainer_old_logprobs=p)
    assert loss.item() == pytest.approx(-1.375, rel=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx(1.25)  # (2 + 0.5) / 2
    assert metrics["tis_capped_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.1, rel=1e-6)
    assert metrics["clip_fraction"] == 0.0
    loss.backward()
    # The weight is a constant: d l / d logprob = -w r A / 2 = [-1.1, -0.275]
    assert logprobs.grad[0].tolist() == approx([-1.1, -0.275])
    # A larger cap lets the 3 through: (-3.3 - 0.55) / 2 = -1.925
    loss, _ = policy_loss(logprobs, mu, t([[1.0, 1.0]]), mask, trainer_old_logprobs=p,
                          tis_cap=5.0)
    assert loss.item() == pytest.approx(-1.925, rel=1e-6)
    # tis_cap=None: no weight, w = 1: (-1.1 - 1.1) / 2 = -1.1
    loss, metrics = policy_loss(logprobs, mu, t([[1.0, 1.0]]), mask, trainer_old_logprobs=p,
                                tis_cap=None)
    assert loss.item() == pytest.approx(-1.1, rel=1e-6) and metrics["tis_weight_mean"] == 1.0


# -- KL to the reference -----------------------------------------------------------------

def test_k3_kl_to_reference():
    # d = ref - logprobs = [ln 2, -ln 2]
    # k3 = exp(d) - d - 1 = [2 - 0.693147 - 1, 0.5 + 0.693147 - 1] = [0.306853, 0.193147]
    # A = 0, so loss = kl_coef * mean k3 = 0.1 * (0.306853 + 0.193147) / 2 = 0.1 * 0.25 = 0.025
    logprobs = t([[-1.0, -1.0]]).requires_grad_(True)
    ref = t([[-1.0 + math.log(2), -1.0 - math.log(2)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = policy_loss(logprobs, logprobs.detach(), t([[0.0, 0.0]]), mask,
                                ref_logprobs=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.025, rel=1e-5)
    assert metrics["kl"] == pytest.approx(0.25, rel=1e-5)
    loss.backward()
    # d k3 / d logprob = 1 - exp(d) = [-1, 0.5]; times 0.1 / 2 tokens = [-0.05, 0.025]
    assert logprobs.grad[0].tolist() == approx([-0.05, 0.025])
    # kl_coef = 0: the KL is reported, not added
    loss, metrics = policy_loss(logprobs, logprobs.detach(), t([[0.0, 0.0]]), mask,
                                ref_logprobs=ref)
    assert loss.item() == 0.0 and metrics["kl"] == pytest.approx(0.25, rel=1e-5)


# -- aggregation, padding, masking -------------------------------------------------------

def test_token_mean_vs_sequence_mean():
    # ratio 1 everywhere, so l = -A. Sequence 0: one trained token, A = 1; sequence 1:
    # three trained tokens, A = 2, 4, 6. Padding holds NaN (never read).
    #   token_mean    = -(1 + 2 + 4 + 6) / 4 = -13 / 4 = -3.25
    #   sequence_mean = -(1 / 1 + (2 + 4 + 6) / 3) / 2 = -(1 + 4) / 2 = -2.5
    nan = math.nan
    logprobs = t([[0.0, -0.5, nan, nan], [0.0, -0.1, -0.2, -0.3]])
    old = logprobs.clone()
    adv = t([[nan, 1.0, nan, nan], [nan, 2.0, 4.0, 6.0]])
    mask = torch.tensor([[False, True, False, False], [False, True, True, True]])
    loss, _ = policy_loss(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx(-3.25)
    loss, _ = policy_loss(logprobs, old, adv, mask, aggregation="sequence_mean")
    assert loss.item() == pytest.approx(-2.5)
    # A sequence with nothing trained does not count in the sequence mean.
    empty_row = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])
    loss, _ = policy_loss(torch.cat([logprobs, logprobs[:1]]), torch.cat([old, old[:1]]),
                          torch.cat([adv, adv[:1]]), empty_row, aggregation="sequence_mean")
    assert loss.item() == pytest.approx(-2.5)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(logprobs, old, adv, mask, aggregation="sum")  # type: ignore[arg-type]


def test_masked_positions_get_exactly_zero_gradient():
    torch.manual_seed(0)
    batch, length, vocab = 3, 8, 11
    logits = (torch.randn(batch, length, vocab) * 3).requires_grad_(True)
    tokens = torch.randint(0, vocab, (batch, length))
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, 2:5] = True          # an assistant turn, then a tool result, then padding
    mask[0, 6:7] = True
    mask[1, 1:8] = True          # full row
    mask[2, 3:4] = True          # mostly prompt
    tokens[0, 7:] = -100         # padding ids
    logprobs = token_logprobs(logits, tokens)
    with torch.no_grad():
        old = logprobs + 0.3 * torch.randn(batch, length)
        trainer_old = logprobs + 0.1 * torch.randn(batch, length)
        ref = logprobs + 0.2 * torch.randn(batch, length)
        # Garbage where nothing is trained: Atropos's 1.0 logprobs, NaN advantages.
        old[~mask] = 1.0
        ref[~mask] = math.nan
    adv = torch.randn(batch, length)
    adv[~mask] = math.nan
    for aggregation in ("token_mean", "sequence_mean"):
        logits.grad = None
        loss, metrics = policy_loss(logprobs, old, adv, mask, trainer_old_logprobs=trainer_old,
                                    ref_logprobs=ref, kl_coef=0.05, aggregation=aggregation)
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
        loss.backward(retain_graph=True)
        grad = logits.grad
        # logits[:, t - 1] predict tokens[:, t]: their gradient comes only from position t.
        for b in range(batch):
            for i in range(1, length):
                row = grad[b, i - 1]
                if mask[b, i]:
                    assert row.abs().sum() > 0
                else:
                    assert torch.all(row == 0), (b, i)
            assert torch.all(grad[b, length - 1] == 0)  # the last logits predict nothing


def test_nothing_trained_gives_zero_not_nan():
    logprobs = t([[0.0, -1.0]]).requires_grad_(True)
    mask = torch.zeros(1, 2, dtype=torch.bool)
    for aggregation in ("token_mean", "sequence_mean"):
        loss, metrics = policy_loss(logprobs, logprobs.detach(), t([[1.0, 1.0]]), mask,
                                    aggregation=aggregation)
        assert loss.item() == 0.0 and metrics["n_tokens"] == 0.0
    assert sft_loss(logprobs, mask).item() == 0.0


def test_mask_must_be_bool():
    logprobs = t([[0.0, -1.0]])
    with pytest.raises(TypeError, match="bool"):
        policy_loss(logprobs, logprobs, t([[1.0, 1.0]]), torch.tensor([[-100, 5]]))
    with pytest.raises(ValueError, match="does not match"):
        sft_loss(logprobs, torch.ones(1, 3, dtype=torch.bool))


def test_per_sequence_advantages_broadcast():
    # advantages [B] = [1, -2] with ratio 1: l = -A per token; tokens trained: 2 and 1
    # token mean = -(1 + 1 - 2) / 3 = 0
    logprobs = t([[0.0, -1.0, -1.0], [0.0, -1.0, 5.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    loss, _ = policy_loss(logprobs, logprobs, t([1.0, -2.0]), mask)
    assert loss.item() == pytest.approx(0.0, abs=1e-7)


# -- SFT ---------------------------------------------------------------------------------

def test_sft_loss_mean_nll_over_trained_tokens():
    # trained logprobs -1, -2 (sequence 0) and -3 (sequence 1): (1 + 2 + 3) / 3 = 2
    nan = math.nan
    logprobs = t([[0.0, -1.0, -2.0, nan], [0.0, -3.0, nan, nan]]).requires_grad_(True)
    mask = torch.tensor([[False, True, True, False], [False, True, False, False]])
    loss = sft_loss(logprobs, mask)
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    assert logprobs.grad.flatten().tolist() == approx([0.0, -1 / 3, -1 / 3, 0.0,
                                                      0.0, -1 / 3, 0.0, 0.0])
