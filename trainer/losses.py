"""Token log-probabilities and the policy-gradient / SFT losses (torch).

Shapes and alignment
--------------------
Every per-token tensor is ``[B, T]`` (any leading shape works, as long as all agree),
aligned with the *token* it is about: position ``t`` of ``logprobs``, ``old_logprobs``,
``advantages``, ``ref_logprobs`` and ``mask`` all refer to ``tokens[:, t]``. That is the
alignment of the data contract (``masks``, ``inference_logprobs`` and the advantages are
per token), so a trajectory's fields drop in without shifting: ``mask = masks != -100``.
:func:`token_logprobs` produces log-probabilities in that alignment from causal-LM logits.

``mask`` is a bool tensor, True at the trained positions; it must be False at padding
and at position 0 (nothing predicts the first token). Masked positions are never read:
inputs are replaced by 0 there with ``torch.where`` before any arithmetic, so padding may
hold anything (Atropos's ``1.0`` logprobs, NaN), contributes nothing to the loss and gets
exactly zero gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token_mean", "sequence_mean", "constant"]

_MAX_LOG_RATIO = 20.0
"""|log ratio| is clamped here before ``exp`` so a wild token cannot overflow the loss;
e^20 ~ 4.9e8 is far outside any clip range, so only already-clipped or hopeless tokens
are affected."""


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """Log-probability of each token given the tokens before it.

    ``logits``: ``[..., T, V]`` from a causal LM run on ``tokens`` (``[..., T]``), so
    ``logits[..., t, :]`` predicts ``tokens[..., t + 1]``. Returns ``[..., T]`` float32
    aligned with ``tokens``::

        out[..., t] = log softmax(logits[..., t - 1, :])[tokens[..., t]]   for t >= 1
        out[..., 0] = 0                                                    (no prediction)

    i.e. ``out[t] = log p(tokens[t] | tokens[<t])``, the same alignment as vLLM's
    ``token_logprobs`` and the data contract's ``inference_logprobs``. The last position's
    logits are unused (they predict a token that is not there). Computed in float32 as
    ``logit[token] - logsumexp(logits)``. Token ids outside ``[0, V)`` (e.g. ``-100``
    padding) are clamped into range: their value is meaningless and must be masked.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens "
                         f"{tuple(tokens.shape)} (expected [..., T, V] and [..., T])")
    picked = selected_logprobs(logits[..., :-1, :], tokens[..., 1:])
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)


def selected_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """``log softmax(logits)[..., targets]`` in float32: ``logits`` ``[..., V]`` and
    ``targets`` ``[...]`` already paired (no shift); ids outside ``[0, V)`` are clamped."""
    logits = logits.float()
    targets = targets.long().clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Forward and backward of :func:`chunked_token_logprobs`, one chunk of rows at a time."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                chunk_size: int) -> Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = torch.nn.functional.linear(hidden[rows], weight, bias).float()
            lse[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(-1, targets[rows, None])[:, 0] - lse[rows]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias and bias is not None else None
        grad = grad.float()
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            logits = torch.nn.functional.linear(hidden[rows], weight, bias).float()
            # d out_i / d logits_ij = [j == y_i] - softmax(logits_i)_j
            dlogits = torch.exp(logits.sub_(lse[rows, None])).mul_(-grad[rows, None])
            dlogits.scatter_add_(-1, targets[rows, None], grad[rows, None])
            dlogits = dlogits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = dlogits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(dlogits.t(), hidden[rows])
            if grad_bias is not None:
                grad_bias += dlogits.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                           chunk_size: int = 1024, bias: Tensor | None = None) -> Tensor:
    """Log-probability of ``targets`` under the output projection of ``hidden``, without
    ever holding the ``[N, V]`` logits of all rows (memory-bounded :func:`token_logprobs`).

    ``hidden``: ``[N, H]`` final hidden states (the rows that predict a token),
    ``weight``: ``[V, H]`` output projection (``bias``: ``[V]`` or None), ``targets``:
    ``[N]`` token ids in ``[0, V)``. Returns ``[N]`` float32::

        z_i   = hidden_i @ weight^T + bias            (float32 after the matmul)
        out_i = z_i[targets_i] - logsumexp_j z_ij

    Rows are processed ``chunk_size`` at a time: the forward keeps only the ``[N]``
    logsumexps; the backward recomputes each chunk's logits and uses
    ``d out_i / d z_ij = [j = targets_i] - softmax(z_i)_j``, so the peak extra memory is
    a few ``[chunk_size, V]`` tensors instead of several ``[N, V]`` ones, for one more
    output-projection matmul. Pure torch (CPU and GPU); the weight gradient accumulates in
    the weight's dtype.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: "
                         "expected [N, H] and [N]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    targets = targets.long().clamp(0, weight.shape[0] - 1)
    return _ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, chunk_size)


def _check_mask(mask: Tensor, like: Tensor) -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor of trained positions (e.g. "
                        f"masks != -100), got {mask.dtype}")
    if mask.shape != like.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match logprobs "
                         f"{tuple(like.shape)}")


def _masked(values: Tensor, mask: Tensor, like: Tensor, name: str) -> Tensor:
    """``values`` (detached) at trained positions, 0 elsewhere; ``[B]`` broadcasts."""
    values = values.detach().to(dtype=like.dtype, device=like.device)
    if values.dim() == like.dim() - 1:
        values = values.unsqueeze(-1)
    try:
        return torch.where(mask, values, torch.zeros((), dtype=like.dtype, device=like.device))
    except RuntimeError as error:
        raise ValueError(f"{name} {tuple(values.shape)} does not fit logprobs "
                         f"{tuple(like.shape)}") from error


def _aggregate(per_token: Tensor, mask: Tensor, aggregation: Aggregation,
               constant: float | None = None) -> Tensor:
    """token_mean: ``sum_{b,t} l / sum_{b,t} m``; sequence_mean: ``mean_b (sum_t l / sum_t m)``
    over the sequences with at least one trained token; constant (Dr. GRPO):
    ``sum_{b,t} l / (n_sequences * constant)`` with ``n_sequences`` those with a trained
    token. An empty batch gives 0."""
    if aggregation == "token_mean":
        return per_token.sum() / mask.sum().clamp(min=1)
    counts = mask.sum(dim=-1)
    n_sequences = (counts > 0).sum().clamp(min=1)
    if aggregation == "sequence_mean":
        per_sequence = per_token.sum(dim=-1) / counts.clamp(min=1)
        return per_sequence.sum() / n_sequences
    if aggregation == "constant":
        if constant is None or constant <= 0:
            raise ValueError(f"aggregation 'constant' needs a positive constant, got {constant}")
        return per_token.sum() / (n_sequences * constant)
    raise ValueError(f"aggregation must be 'token_mean', 'sequence_mean' or 'constant', "
                     f"got {aggregation!r}")


def _masked_mean(values: Tensor, mask: Tensor, n: int) -> float:
    return float(torch.where(mask, values, torch.zeros_like(values)).sum()) / max(n, 1)


def _exp(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


# -- units of GSPO's ratio ---------------------------------------------------------------

def turn_units(mask: Tensor) -> Tensor:
    """An id per trained token naming its assistant turn: each maximal run of trained
    tokens of a row (the sampled tokens of one turn; tool results and prompts between
    turns are masked) gets its own id, unique across the batch; -1 where not trained."""
    starts = mask & ~torch.nn.functional.pad(mask[..., :-1], (1, 0), value=False)
    ids = torch.cumsum(starts.flatten(), 0).view_as(mask) - 1
    return torch.where(mask, ids, torch.full_like(ids, -1))


def sequence_units(mask: Tensor) -> Tensor:
    """Row index per trained token (-1 where not trained): one GSPO ratio per sequence."""
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1).expand_as(mask)
    return torch.where(mask, rows, torch.full_like(rows, -1))


def unit_mean(values: Tensor, units: Tensor, mask: Tensor) -> Tensor:
    """Each trained token gets the mean of ``values`` over the trained tokens of its unit
    (differentiable); 0 where not trained."""
    n = int(units.max()) + 1 if bool(mask.any()) else 0
    flat_mask = mask.flatten()
    index = units.flatten()[flat_mask]
    picked = values.flatten()[flat_mask]
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, index, picked)
    counts = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(
        0, index, torch.ones_like(picked))
    index = units.clamp(min=0).flatten()
    means = (sums / counts.clamp(min=1))[index].view_as(values)
    return torch.where(mask, means, torch.zeros_like(values))


UNITS = {"sequence": sequence_units, "turn": turn_units}


# -- policy objectives: per-token loss from the log ratio against pi_old -----------------
# Each returns (per-token loss before the mismatch weight, ratio, clipped-token mask).

def ppo_clip(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *,
             clip_low: float, clip_high: float, **_) -> tuple[Tensor, Tensor, Tensor]:
    """PPO / GRPO / DAPO: ``-min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)``."""
    ratio = _exp(log_ratio)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    return loss, ratio, _clipped(ratio, adv, clip_low, clip_high)


def gspo(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *,
         clip_low: float, clip_high: float, units: Tensor, **_) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO (arXiv 2507.18071): one ratio per unit (sequence, or turn),
    ``s = exp(mean_{t in unit} log r_t)``, clipped like PPO:
    ``-min(s A_t, clip(s, 1 - eps_low, 1 + eps_high) A_t)`` on each of its tokens (with
    ``sequence_mean`` and a sequence's constant advantage, exactly the paper's objective);
    the gradient reaches each token through the mean, ``s / |unit|``."""
    ratio = _exp(unit_mean(log_ratio, units, mask))
    loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    return loss, ratio, _clipped(ratio, adv, clip_low, clip_high)


def gspo_token(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *,
               clip_low: float, clip_high: float, units: Tensor,
               **_) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO-token: ``s_t = sg(s) * pi(y_t) / sg(pi(y_t))``: the value of GSPO's unit ratio
    ``s``, with the gradient ``s * grad log pi(y_t)`` flowing per token (per-token
    advantages allowed), clipped as GSPO."""
    s = _exp(unit_mean(log_ratio, units, mask)).detach()
    ratio = s * torch.exp(logprobs - logprobs.detach())
    loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    return loss, ratio, _clipped(ratio, adv, clip_low, clip_high)


def cispo(logprobs: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, *,
          clip_low: float, clip_high: float, **_) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): ``-sg(clip(r_t, 1 - eps_low, 1 + eps_high))
    A_t log pi(y_t)``: the importance weight is clipped and detached, every token keeps a
    gradient. The clip fraction counts tokens whose weight was clipped."""
    ratio = _exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return -weight * adv * logprobs, ratio, clipped


def _clipped(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """Tokens where PPO's clipped term is the one taken (no gradient)."""
    return ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low))


OBJECTIVES = {"ppo_clip": ppo_clip, "gspo": gspo, "gspo_token": gspo_token, "cispo": cispo}
"""``loss`` name -> objective ``(logprobs, log_ratio, adv, mask, *, clip_low, clip_high,
units) -> (per-token loss, ratio, clipped)``."""


# -- train/inference mismatch: a detached weight per token from p (trainer) vs mu (vLLM) --

def tis(log_ratio: Tensor, mask: Tensor, *, tis_cap: float | None, **_) -> Tensor:
    """Truncated importance sampling: ``min(p / mu, C)`` (``C = tis_cap``; None: 1)."""
    if tis_cap is None:
        return torch.ones_like(log_ratio)
    return _exp(log_ratio).clamp(max=tis_cap)


def mis_token(log_ratio: Tensor, mask: Tensor, *, mis_low: float, mis_high: float,
              **_) -> Tensor:
    """Token masked importance sampling (IcePop): ``p / mu`` where it lies in
    ``[lo, hi]``, 0 (the token is masked) where it leaves the band."""
    ratio = _exp(log_ratio)
    return torch.where((ratio >= mis_low) & (ratio <= mis_high), ratio, torch.zeros_like(ratio))


def mis_sequence(log_ratio: Tensor, mask: Tensor, *, mis_low: float, mis_high: float,
                 **_) -> Tensor:
    """Sequence masked importance sampling: the row's geometric-mean ratio
    ``g = exp(mean_t log(p_t / mu_t))`` on each of its tokens where it lies in
    ``[lo, hi]``; 0 on the whole row (dropped) where it leaves the band."""
    g = _exp(unit_mean(log_ratio, sequence_units(mask), mask))
    return torch.where((g >= mis_low) & (g <= mis_high), g, torch.zeros_like(g))


def no_correction(log_ratio: Tensor, mask: Tensor, **_) -> Tensor:
    return torch.ones_like(log_ratio)


MISMATCH = {"tis": tis, "mis_token": mis_token, "mis_sequence": mis_sequence,
            "none": no_correction}
"""``mismatch`` name -> weight ``(log(p / mu), mask, *, tis_cap, mis_low, mis_high)``."""

Objective = Literal["ppo_clip", "gspo", "gspo_token", "cispo"]
Mismatch = Literal["tis", "mis_token", "mis_sequence", "none"]


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    tis_cap: float | None = 2.0,
    trainer_old_logprobs: Tensor | None = None,
    aggregation: Aggregation = "token_mean",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    loss: Objective = "ppo_clip",
    mismatch: Mismatch = "tis",
    mis_low: float = 0.5,
    mis_high: float = 5.0,
    gspo_unit: Literal["sequence", "turn"] = "sequence",
    constant: float | None = None,
    without_behaviour: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The policy-gradient loss: an objective (``loss``), a train/inference mismatch
    correction (``mismatch``), a k3 KL penalty and a normaliser (``aggregation``).

    Inputs are ``[B, T]``, aligned per token (module docstring): ``logprobs`` (with grad)
    under the policy being trained; ``old_logprobs`` from the behaviour policy that
    sampled the tokens (vLLM's ``inference_logprobs``); ``advantages`` per token (``[B]``
    broadcasts); ``mask`` bool. Per trained token, with ``mu`` the behaviour logprob::

        without trainer_old_logprobs:  log r = logprobs - mu,              w = 1
        with trainer_old_logprobs p:   log r = logprobs - p,
                                       w = mismatch(p - mu)                (detached)
        l_t = w * objective(log r, A)_t
              + kl_coef * (exp(ref - logprobs) - (ref - logprobs) - 1)

    ``p`` are the trainer's own logprobs of the tokens under ``pi_old`` (no grad): the
    weights that sampled them, or, with several optimizer steps per batch, the weights at
    the start of the batch (decoupled PPO). vLLM and the trainer compute slightly
    different probabilities for the same weights, so the ratio is taken against the
    trainer's ``pi_old`` and the mismatch is corrected by ``w`` (:data:`MISMATCH`: ``tis``
    truncates ``p/mu`` at ``tis_cap`` (None: ``w = 1``), ``mis_token`` / ``mis_sequence``
    mask tokens / rows whose ratio leaves ``[mis_low, mis_high]``). Objectives
    (:data:`OBJECTIVES`): ``ppo_clip``, ``gspo`` and ``gspo_token`` (ratio per
    ``gspo_unit``: sequence, or assistant turn), ``cispo``. The last term is the k3
    estimator of ``KL(pi || pi_ref)`` (always >= 0), added when ``ref_logprobs`` are given
    and ``kl_coef != 0``.

    ``without_behaviour`` (bool, like ``mask``): tokens whose ``old_logprobs`` are not the
    behaviour policy's but the trainer's own at the batch's start (the env sent no
    ``inference_logprobs``): there is no train/inference mismatch to correct, so ``w = 1``
    on them and they add 0 to the mismatch metrics.

    Aggregation: ``"token_mean"`` = sum of ``l_t`` over all trained tokens of the batch /
    their number; ``"sequence_mean"`` = mean over each sequence's trained tokens, then
    mean over the sequences that have any; ``"constant"`` = sum over all trained tokens /
    (number of sequences * ``constant``) (Dr. GRPO). Masked positions contribute nothing
    and get exactly zero gradient; tokens the mismatch correction masks still count in
    the normaliser.

    Returns ``(loss, metrics)``; metrics are floats over the trained tokens:
    ``clip_fraction`` (tokens where the objective clipped), ``approx_kl``
    (k3 estimate of KL(behaviour || current): mean of ``rho_b - 1 - log rho_b`` with
    ``rho_b = exp(logprobs - mu)``), ``ratio_mean``/``ratio_max`` (of the objective's
    ratio), ``tis_weight_mean`` (of ``w``) and ``tis_capped_fraction``,
    ``mismatch_masked_fraction`` (tokens ``w`` masked), ``mismatch_kl`` (k3 estimate of
    KL(vLLM || trainer pi_old)), ``kl`` (k3 to the reference, when given) and
    ``n_tokens``.
    """
    _check_mask(mask, logprobs)
    try:
        objective, correction, units_of = OBJECTIVES[loss], MISMATCH[mismatch], UNITS[gspo_unit]
    except KeyError as error:
        raise ValueError(f"unknown loss, mismatch or gspo_unit {error}; expected loss in "
                         f"{list(OBJECTIVES)}, mismatch in {list(MISMATCH)}, gspo_unit in "
                         f"{list(UNITS)}") from None
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    current = torch.where(mask, logprobs, zero)
    behaviour = _masked(old_logprobs, mask, current, "old_logprobs")
    adv = _masked(advantages, mask, current, "advantages")
    weight = torch.ones_like(current)
    mismatch_log_ratio = None
    if trainer_old_logprobs is not None:
        proximal = _masked(trainer_old_logprobs, mask, current, "trainer_old_logprobs")
        log_ratio = current - proximal
        mismatch_log_ratio = proximal - behaviour
        if without_behaviour is not None:
            mismatch_log_ratio = torch.where(without_behaviour, zero, mismatch_log_ratio)
        weight = correction(mismatch_log_ratio, mask, tis_cap=tis_cap, mis_low=mis_low,
                            mis_high=mis_high).detach()
        if without_behaviour is not None:
            weight = torch.where(without_behaviour, torch.ones_like(weight), weight)
    else:
        log_ratio = current - behaviour
    per_token, ratio, is_clipped = objective(
        current, log_ratio, adv, mask, clip_low=clip_low, clip_high=clip_high,
        units=units_of(mask) if loss in ("gspo", "gspo_token") else None)
    per_token = per_token * weight
    kl = None
    if ref_logprobs is not None:
        ref = _masked(ref_logprobs, mask, current, "ref_logprobs")
        diff = (ref - current).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.exp(diff) - diff - 1.0
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
    per_token = torch.where(mask, per_token, zero)
    total = _aggregate(per_token, mask, aggregation, constant)

    with torch.no_grad():
        n = int(mask.sum())
        behaviour_log_ratio = (current - behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3_behaviour = torch.exp(behaviour_log_ratio) - 1.0 - behaviour_log_ratio
        metrics = {
            "clip_fraction": _masked_mean(is_clipped.to(current.dtype), mask, n),
            "approx_kl": _masked_mean(k3_behaviour, mask, n),
            "ratio_mean": _masked_mean(ratio.detach(), mask, n),
            "ratio_max": float(ratio.detach()[mask].max()) if n else 0.0,
            "tis_weight_mean": _masked_mean(weight, mask, n) if n else 1.0,
            "tis_capped_fraction": 0.0,
            "mismatch_masked_fraction": 0.0,
            "mismatch_kl": 0.0,
            "n_tokens": float(n),
        }
        if mismatch_log_ratio is not None:
            d = mismatch_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            metrics["mismatch_kl"] = _masked_mean(torch.exp(d) - 1.0 - d, mask, n)
            if mismatch == "tis" and tis_cap is not None:
                metrics["tis_capped_fraction"] = _masked_mean(
                    (torch.exp(d) > tis_cap).to(current.dtype), mask, n)
            metrics["mismatch_masked_fraction"] = _masked_mean(
                (weight == 0).to(current.dtype), mask, n)
        if kl is not None:
            metrics["kl"] = _masked_mean(kl, mask, n)
    return total, metrics


def sft_loss(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Mean negative log-likelihood over the trained tokens:
    ``-sum_{b,t} m_{b,t} logprobs_{b,t} / sum_{b,t} m_{b,t}`` (0 when nothing is trained).
    Same shapes and alignment as :func:`policy_loss`; masked positions are never read."""
    _check_mask(mask, logprobs)
    picked = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype,
                                                      device=logprobs.device))
    return -picked.sum() / mask.sum().clamp(min=1)
