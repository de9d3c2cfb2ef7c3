"""The policy objectives, mismatch corrections and normalisers of ``trainer.losses``
against references written here from the papers' formulas (per row, per token, in plain
loops), on random batches with mixed lengths and turn counts: values and gradients. And
several optimizer steps per batch: the clip binds from the second mini-batch on."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_turn_prefix import groups, tiny_qwen2

from trainer.config import TrainConfig
from trainer.losses import policy_loss
from trainer.train import Batch, batch_tensors, train_steps

EL, EH = 0.2, 0.28  # DAPO's clip-higher


def random_batch(seed: int, rows: int = 6, per_row_advantage: bool = False):
    """Rows of 8-20 tokens, 1-3 assistant turns each (runs of trained tokens with masked
    tool tokens between them), padded; trainer logprobs ``lp`` (a leaf with grad), the
    trainer's pi_old ``p`` (ratios inside and outside the clip range) and vLLM's ``mu``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [rng.randint(8, 20) for _ in range(rows)]
    width = max(lengths) + 2
    mask = torch.zeros(rows, width, dtype=torch.bool)
    turns = []
    for i, n in enumerate(lengths):
        spans, position = [], rng.randint(1, 3)
        for _ in range(rng.randint(1, 3)):
            end = min(n, position + rng.randint(1, 5))
            if position >= end:
                break
            spans.append((position, end))
            position = end + rng.randint(1, 3)
        for start, end in spans:
            mask[i, start:end] = True
        turns.append(spans)
    lp = (-torch.rand(rows, width, generator=gen) * 3).requires_grad_(True)
    p = lp.detach() + torch.randn(rows, width, generator=gen) * 0.3
    mu = p + torch.randn(rows, width, generator=gen) * 0.5
    if per_row_advantage:
        adv = torch.randn(rows, 1, generator=gen).expand(rows, width).clone()
    else:
        adv = torch.randn(rows, width, generator=gen)
    return lp, p, mu, adv, mask, turns


def positions(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def ppo_term(ratio, a):
    return -torch.minimum(ratio * a, clip(ratio, 1 - EL, 1 + EH) * a)


def check(loss, reference, lp):
    """Same value, same gradient with respect to the trainer's logprobs."""
    (got_grad,) = torch.autograd.grad(loss, lp, retain_graph=True)
    (want_grad,) = torch.autograd.grad(reference, lp)
    assert float(loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


def run(lp, p, mu, adv, mask, **options):
    options = {"clip_low": EL, "clip_high": EH, "mismatch": "none", **options}
    return policy_loss(lp, mu, adv, mask, trainer_old_logprobs=p, **options)


@pytest.mark.parametrize("seed", range(5))
def test_gspo_sequence_ratio(seed):
    # GSPO: s_i = exp(1/|y_i| sum_t log(pi/pi_old)); J = mean_i min(s_i A_i, clip(s_i) A_i)
    lp, p, mu, adv, mask, _ = random_batch(seed, per_row_advantage=True)
    terms = []
    for i in range(mask.shape[0]):
        ts = positions(mask, i)
        s = torch.exp(sum(lp[i, t] - p[i, t] for t in ts) / len(ts))
        terms.append(ppo_term(s, adv[i, 0]))
    reference = sum(terms) / len(terms)
    loss, metrics = run(lp, p, mu, adv, mask, loss="gspo", aggregation="sequence_mean")
    check(loss, reference, lp)


@pytest.mark.parametrize("seed", range(5))
def test_gspo_turn_ratio(seed):
    # gspo_unit: turn: one ratio per assistant turn, s_ik over turn k's tokens.
    lp, p, mu, adv, mask, turns = random_batch(seed)
    rows = []
    for i, spans in enumerate(turns):
        terms = []
        for start, end in spans:
            s = torch.exp(sum(lp[i, t] - p[i, t] for t in range(start, end)) / (end - start))
            terms += [ppo_term(s, adv[i, t]) for t in range(start, end)]
        rows.append(sum(terms) / len(terms))
    reference = sum(rows) / len(rows)
    loss, _ = run(lp, p, mu, adv, mask, loss="gspo", gspo_unit="turn",
                  aggregation="sequence_mean")
    check(loss, reference, lp)


@pytest.mark.parametrize("seed", range(5))
def test_gspo_token_has_gspo_value_and_per_token_gradient(seed):
    # GSPO-token: s_it = sg(s_i) pi(y_t) / sg(pi(y_t)); J = mean_i mean_t min(s_it A_it, ...)
    lp, p, mu, adv, mask, _ = random_batch(seed)
    rows = []
    for i in range(mask.shape[0]):
        ts = positions(mask, i)
        s = torch.exp(sum(lp[i, t] - p[i, t] for t in ts) / len(ts)).detach()
        rows.append(sum(ppo_term(s * torch.exp(lp[i, t] - lp[i, t].detach()), adv[i, t])
                        for t in ts) / len(ts))
    reference = sum(rows) / len(rows)
    loss, _ = run(lp, p, mu, adv, mask, loss="gspo_token", aggregation="sequence_mean")
    check(loss, reference, lp)
    # with one advantage per sequence, GSPO-token's value is GSPO's
    lp, p, mu, adv, mask, _ = random_batch(seed, per_row_advantage=True)
    token, _ = run(lp, p, mu, adv, mask, loss="gspo_token", aggregation="sequence_mean")
    sequence, _ = run(lp, p, mu, adv, mask, loss="gspo", aggregation="sequence_mean")
    assert float(token.detach()) == pytest.approx(float(sequence.detach()), rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_cispo(seed):
    # CISPO: J = 1/N sum_{i,t} sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_it log pi(y_it)
    lp, p, mu, adv, mask, _ = random_batch(seed)
    terms = [-clip(torch.exp(lp[i, t] - p[i, t]), 1 - EL, 1 + EH).detach()
             * adv[i, t] * lp[i, t]
             for i in range(mask.shape[0]) for t in positions(mask, i)]
    reference = sum(terms) / len(terms)
    loss, metrics = run(lp, p, mu, adv, mask, loss="cispo")
    check(loss, reference, lp)
    ratios = [math.exp(float(lp[i, t].detach() - p[i, t]))
              for i in range(mask.shape[0]) for t in positions(mask, i)]
    clipped = sum(not 1 - EL <= r <= 1 + EH for r in ratios) / len(ratios)
    assert metrics["clip_fraction"] == pytest.approx(clipped)


@pytest.mark.parametrize("mismatch", ["tis", "mis_token", "mis_sequence"])
@pytest.mark.parametrize("seed", range(4))
def test_mismatch_corrections(mismatch, seed):
    # tis: w = min(p/mu, C); token MIS: w = p/mu inside [lo, hi], else 0 (masked);
    # sequence MIS: w = g_i = exp(mean_t log(p/mu)) inside [lo, hi], else 0 (row dropped).
    lo, hi, cap = (0.9, 1.1, 1.3) if mismatch == "mis_sequence" else (0.7, 1.5, 1.3)
    lp, p, mu, adv, mask, _ = random_batch(seed)
    terms, weights, k3 = [], [], []
    for i in range(mask.shape[0]):
        ts = positions(mask, i)
        g = math.exp(sum(float(p[i, t] - mu[i, t]) for t in ts) / len(ts))
        for t in ts:
            rho = math.exp(float(p[i, t] - mu[i, t]))
            w = {"tis": min(rho, cap), "mis_token": rho if lo <= rho <= hi else 0.0,
                 "mis_sequence": g if lo <= g <= hi else 0.0}[mismatch]
            weights.append(w)
            k3.append(rho - 1 - math.log(rho))
            terms.append(w * ppo_term(torch.exp(lp[i, t] - p[i, t]), adv[i, t]))
    reference = sum(terms) / len(terms)
    loss, metrics = run(lp, p, mu, adv, mask, mismatch=mismatch, tis_cap=cap, mis_low=lo,
                        mis_high=hi)
    check(loss, reference, lp)
    assert metrics["mismatch_masked_fraction"] == pytest.approx(
        sum(w == 0 for w in weights) / len(weights))
    assert metrics["mismatch_kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-5)
    if mismatch != "tis":
        assert 0 < metrics["mismatch_masked_fraction"] < 1  # the band binds in these batches


@pytest.mark.parametrize("seed", range(3))
def test_constant_normaliser(seed):
    # Dr. GRPO: J = 1/G sum_i 1/L sum_t l_it with a constant L, not |y_i|.
    lp, p, mu, adv, mask, _ = random_batch(seed)
    L = 37
    terms = [ppo_term(torch.exp(lp[i, t] - p[i, t]), adv[i, t])
             for i in range(mask.shape[0]) for t in positions(mask, i)]
    reference = sum(terms) / (mask.shape[0] * L)
    loss, _ = run(lp, p, mu, adv, mask, aggregation="constant", constant=L)
    check(loss, reference, lp)


def test_defaults_are_todays_loss():
    # ppo_clip + tis + token_mean are the defaults; a ratio of 1 never clips.
    lp, p, mu, adv, mask, _ = random_batch(0)
    default, _ = policy_loss(lp, mu, adv, mask, trainer_old_logprobs=p, clip_high=EH)
    terms = [min(math.exp(float(p[i, t] - mu[i, t])), 2.0)
             * ppo_term(torch.exp(lp[i, t] - p[i, t]), adv[i, t])
             for i in range(mask.shape[0]) for t in positions(mask, i)]
    check(default, sum(terms) / len(terms), lp)


def test_unknown_loss_is_named():
    lp, p, mu, adv, mask, _ = random_batch(0)
    with pytest.raises(ValueError, match="unknown loss, mismatch or gspo_unit 'ppo'"):
        policy_loss(lp, mu, adv, mask, loss="ppo")


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
def test_the_clip_binds_from_the_second_mini_batch_on(loss):
    """Decoupled PPO: pi_old is the trainer's logprobs before the first step. One step per
    batch: the ratio is 1, nothing clips. Several: the first mini-batch's ratio is 1, the
    later ones were moved by the earlier steps and clip."""
    fractions = {}
    for mini_batches in (1, 2, 4):
        config = TrainConfig(model="m", estimator="mt_grpo", loss=loss, mini_batches=mini_batches,
                             clip_low=0.02, clip_high=0.02, max_grad_norm=None,
                             micro_batch_size=3)
        tensors, _ = batch_tensors(Batch(groups()), config, vocab_size=64, pad_id=0)
        model = tiny_qwen2()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
        metrics = train_steps(model, optimizer, tensors, config)
        assert all(math.isfinite(v) for v in metrics.values())
        fractions[mini_batches] = metrics
    assert fractions[1]["clip_fraction"] == 0.0
    for mini_batches in (2, 4):
        assert fractions[mini_batches]["optimizer_steps"] == mini_batches
        assert fractions[mini_batches]["clip_fraction_first"] == 0.0
        assert fractions[mini_batches]["clip_fraction_last"] > 0.0


@pytest.fixture(scope="module")
def arithmetic_rollouts(vllm_server, tmp_path_factory):
    """The quickstart's task: 4 groups x 4 arithmetic_tool episodes sampled by vLLM."""
    import asyncio

    from environments.envs.arithmetic_tool import ArithmeticToolConfig, ArithmeticToolEnv

    out = tmp_path_factory.mktemp("arith") / "groups.jsonl"
    config = ArithmeticToolConfig(tokenizer=str(vllm_server.model_dir),
                                  inference_servers=[vllm_server.url], group_size=4,
                                  max_turns=2, max_tokens_per_turn=16, max_token_length=1024,
                                  keep_equal_score_groups=True)

    async def collect():
        env = ArithmeticToolEnv(config)
        await env.start()
        try:
            await env.process(out, 4)
        finally:
            await env.close()

    asyncio.run(collect())
    return out


@pytest.mark.parametrize("options", [
    {"loss": "ppo_clip"},
    {"loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "sequence_mean"},
    {"loss": "gspo_token", "gspo_unit": "turn", "clip_low": 3e-4, "clip_high": 4e-4},
    {"loss": "cispo", "clip_low": 10.0, "clip_high": 0.28, "mismatch": "mis_token"},
    {"loss": "ppo_clip", "aggregation": "constant", "advantage_std_scaling": False,
     "mismatch": "mis_sequence", "mis_low": 0.9, "mis_high": 1.1},
    {"loss": "ppo_clip", "estimator": "gigpo", "gamma": 0.95, "overlong_buffer": 8,
     "overlong_max_tokens": 24},
], ids=["ppo_clip", "gspo", "gspo_token_turn", "cispo_mis", "dr_grpo_seq_mis", "gigpo_overlong"])
def test_each_objective_trains_on_the_quickstart_task_without_nan(options, arithmetic_rollouts,
                                                                 vllm_server, tmp_path):
    """Two real steps (2 mini-batches x 2 epochs each: 8 optimizer steps, the second step's
    from weights and Adam moments the first moved) on episodes vLLM sampled, every group
    trained once (a third step, 4 s of each of the six beside the suite, trained the first
    batch's groups again)."""
    import asyncio
    import json

    from trainer.train import train

    config = TrainConfig(model=str(vllm_server.model_dir), data=arithmetic_rollouts,
                         run_dir=tmp_path / "run", batch_size=8, micro_batch_size=4, steps=2,
                         lr=1e-3, mini_batches=2, epochs=2, tensorboard=False,
                         checkpoint_every=100, **options)
    summary = asyncio.run(train(config))
    assert summary["last_step"] == 2
    lines = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").open()]
    assert all(math.isfinite(v) for m in lines for v in m.values() if isinstance(v, float))
    assert all(m["optimizer_steps"] == 4 for m in lines if "optimizer_steps" in m)
