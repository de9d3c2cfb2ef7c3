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

Aggregation = Literal["token_mean", "sequence_mean"]

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


def _aggregate(per_token: Tensor, mask: Tensor, aggregation: Aggregation) -> Tensor:
    """token_mean: ``sum_{b,t} l / sum_{b,t} m``; sequence_mean: ``mean_b (sum_t l / sum_t m)``
    over the sequences with at least one trained token. An empty batch gives 0."""
    if aggregation == "token_mean":
        return per_token.sum() / mask.sum().clamp(min=1)
    if aggregation == "sequence_mean":
        counts = mask.sum(dim=-1)
        per_sequence = per_token.sum(dim=-1) / counts.clamp(min=1)
        return per_sequence.sum() / (counts > 0).sum().clamp(min=1)
    raise ValueError(f"aggregation must be 'token_mean' or 'sequence_mean', got {aggregation!r}")


def _masked_mean(values: Tensor, mask: Tensor, n: int) -> float:
    return float(torch.where(mask, values, torch.zeros_like(values)).sum()) / max(n, 1)


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
) -> tuple[Tensor, dict[str, float]]:
    """Clipped PPO/GRPO surrogate with truncated importance sampling and a k3 KL penalty.

    Inputs are ``[B, T]``, aligned per token (module docstring): ``logprobs`` (with grad)
    under the policy being trained; ``old_logprobs`` from the behaviour policy that
    sampled the tokens (vLLM's ``inference_logprobs``); ``advantages`` per token (``[B]``
    broadcasts); ``mask`` bool. Per trained token, with ``mu`` the behaviour logprob::

        without trainer_old_logprobs:  rho = exp(logprobs - mu),              w = 1
        with trainer_old_logprobs p:   rho = exp(logprobs - p),
                                       w = min(exp(p - mu), tis_cap)          (detached)
        l_t = -w * min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)
              + kl_coef * (exp(ref - logprobs) - (ref - logprobs) - 1)

    ``p`` are the trainer's own logprobs of the tokens under the weights that sampled them
    (no grad). vLLM and the trainer compute slightly different probabilities for the same
    weights, so the tokens are off-policy for the trainer's ``pi_old``; the PPO ratio is
    then taken against the trainer's ``pi_old`` and the mismatch is corrected by the
    truncated importance weight ``w`` (TIS, Yao et al., "Your efficient RL framework
    secretly brings you off-policy RL training", 2025). ``tis_cap=None`` switches the
    weight off (``w = 1``). The last term is the k3 estimator of ``KL(pi || pi_ref)``
    (always >= 0), added when ``ref_logprobs`` are given and ``kl_coef != 0``.

    Aggregation: ``"token_mean"`` = sum of ``l_t`` over all trained tokens of the batch /
    their number; ``"sequence_mean"`` = mean over each sequence's trained tokens, then
    mean over the sequences that have any. Masked positions contribute nothing and get
    exactly zero gradient.

    Returns ``(loss, metrics)``; metrics are floats over the trained tokens:
    ``clip_fraction`` (tokens where the clipped term is the one taken), ``approx_kl``
    (k3 estimate of KL(behaviour || current): mean of ``rho_b - 1 - log rho_b`` with
    ``rho_b = exp(logprobs - mu)``), ``ratio_mean``/``ratio_max`` (of ``rho``),
    ``tis_weight_mean`` and ``tis_capped_fraction``, ``kl`` (k3 to the reference, when
    given) and ``n_tokens``.
    """
    _check_mask(mask, logprobs)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    current = torch.where(mask, logprobs, zero)
    behaviour = _masked(old_logprobs, mask, current, "old_logprobs")
    adv = _masked(advantages, mask, current, "advantages")
    tis = torch.ones_like(current)
    raw_tis = None
    if trainer_old_logprobs is not None:
        proximal = _masked(trainer_old_logprobs, mask, current, "trainer_old_logprobs")
        log_ratio = current - proximal
        if tis_cap is not None:
            raw_tis = torch.exp((proximal - behaviour).clamp(max=_MAX_LOG_RATIO))
            tis = raw_tis.clamp(max=tis_cap)
    else:
        log_ratio = current - behaviour
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped) * tis
    kl = None
    if ref_logprobs is not None:
        ref = _masked(ref_logprobs, mask, current, "ref_logprobs")
        diff = (ref - current).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.exp(diff) - diff - 1.0
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
    per_token = torch.where(mask, per_token, zero)
    loss = _aggregate(per_token, mask, aggregation)

    with torch.no_grad():
        n = int(mask.sum())
        is_clipped = (((adv > 0) & (ratio > 1.0 + clip_high))
                      | ((adv < 0) & (ratio < 1.0 - clip_low)))
        behaviour_log_ratio = (current - behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3_behaviour = torch.exp(behaviour_log_ratio) - 1.0 - behaviour_log_ratio
        metrics = {
            "clip_fraction": _masked_mean(is_clipped.to(current.dtype), mask, n),
            "approx_kl": _masked_mean(k3_behaviour, mask, n),
            "ratio_mean": _masked_mean(ratio, mask, n),
            "ratio_max": float(ratio[mask].max()) if n else 0.0,
            "tis_weight_mean": _masked_mean(tis, mask, n) if n else 1.0,
            "tis_capped_fraction": (
                _masked_mean((raw_tis > tis_cap).to(current.dtype), mask, n)
                if raw_tis is not None else 0.0),
            "n_tokens": float(n),
        }
        if kl is not None:
            metrics["kl"] = _masked_mean(kl, mask, n)
    return loss, metrics


def sft_loss(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Mean negative log-likelihood over the trained tokens:
    ``-sum_{b,t} m_{b,t} logprobs_{b,t} / sum_{b,t} m_{b,t}`` (0 when nothing is trained).
    Same shapes and alignment as :func:`policy_loss`; masked positions are never read."""
    _check_mask(mask, logprobs)
    picked = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype,
                                                      device=logprobs.device))
    return -picked.sum() / mask.sum().clamp(min=1)
