"""The model's log-probabilities of a micro-batch's tokens: padding-free packing and a
memory-bounded output projection.

A micro-batch arrives as right-padded rows (:class:`trainer.batch.TrainBatch`, ``[B, T]``).
With ``packing`` the rows' real tokens are concatenated into one ``[1, N]`` sequence
(``N = sum of lengths``) whose position ids restart at 0 on every row; transformers reads
that as packed sequences and lets each token attend only to its own row (a block-diagonal
causal mask for SDPA/eager attention, variable-length kernels for flash-attention). No
compute or memory goes to padding. The logprobs come back in the ``[B, T]`` row layout, so
the losses see exactly the tensors of the padded path.

With ``chunk_size`` the output projection, logsumexp and gather run
:func:`trainer.losses.chunked_token_logprobs` on the rows' hidden states, only at the
positions whose logprob is needed (trained tokens), so no ``[tokens, vocab]`` float32
tensor exists for the micro-batch. The model's own ``forward`` still runs (and with it
FSDP2's hooks): for the duration of the call its output embedding computes logprobs
instead of logits. On CUDA, Liger-Kernel's fused linear cross entropy does the same in
Triton when a version with correct per-token gradients is installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools

import torch
from torch import Tensor

from trainer.losses import chunked_token_logprobs, selected_logprobs, token_logprobs

LIGER_MIN_VERSION = (0, 8, 2)
"""Liger's fused linear cross entropy with ``reduction="none"`` multiplied every token's
gradient by the first token's upstream gradient before its PR #1298 (July 2026); the
policy loss weighs tokens differently, so older versions are not used."""


def sequence_logprobs(model: torch.nn.Module, tokens: Tensor, lengths: Tensor, *,
                      packing: bool = False, chunk_size: int | None = None,
                      where: Tensor | None = None) -> Tensor:
    """``out[b, t] = log p(tokens[b, t] | tokens[b, <t])`` as float32 ``[B, T]``; 0 at
    ``t = 0``, on padding (``t >= lengths[b]``) and, when ``where`` (bool ``[B, T]``) is
    given, wherever it is False (those positions are not computed with ``chunk_size``).

    ``packing``: run the rows as one packed sequence (module docstring) instead of a
    padded ``[B, T]`` batch with an attention mask. ``chunk_size``: compute the output
    projection ``chunk_size`` tokens at a time (:func:`chunked_token_logprobs`) at the
    positions that predict a wanted token. None: full float32 logits; padded, of every
    position (:func:`token_logprobs`, the path before packing), packed, of the positions
    that predict a wanted token (``logits_to_keep``)."""
    batch, width = tokens.shape
    given_lengths = lengths  # as the caller has them: read on the host below when packing
    lengths = lengths.to(tokens.device)
    positions = torch.arange(width, device=tokens.device)[None, :].expand(batch, width)
    valid = positions < lengths[:, None]
    wanted = valid & (positions >= 1)
    if where is not None:
        wanted = wanted & where.to(tokens.device)
    if packing:
        bounds = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
        row_lengths = given_lengths.tolist()  # no wait on the device when on the CPU
        _remember_row_edges(bounds, [0, *itertools.accumulate(row_lengths)])
        longest = max(row_lengths, default=0)
        inputs = {"input_ids": tokens[valid][None], "position_ids": positions[valid][None],
                  # row boundaries: flash-attn's varlen kernels and VARLEN_SDPA read them
                  "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
                  "max_length_q": longest, "max_length_k": longest}
        # flat[b, t]: where token (b, t) sits in the packed sequence (rows back to back)
        flat = torch.cumsum(valid.reshape(-1), 0).reshape(batch, width) - 1
    else:
        inputs = {"input_ids": tokens, "attention_mask": valid.long()}
        flat = torch.arange(batch * width, device=tokens.device).reshape(batch, width)
    out = torch.zeros(batch, width, dtype=torch.float32, device=tokens.device)
    if not packing and (chunk_size is None or not _plain_output_projection(model)):
        logits = model(**inputs, use_cache=False).logits  # the padded full-logits path
        return torch.where(wanted, token_logprobs(logits, tokens), out)
    index = wanted.nonzero(as_tuple=True)
    predictors = flat[index] - 1  # the hidden state that predicts token (b, t): same row
    targets = tokens[index]
    if chunk_size is None or not _plain_output_projection(model):
        # full float32 logits, but only of the packed positions that predict a wanted token
        logits = model(**inputs, use_cache=False, logits_to_keep=predictors).logits[0]
        return out.index_put(index, selected_logprobs(logits, targets))
    head = model.get_output_embeddings()

    def logprobs_head(hidden: Tensor) -> Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])[predictors]
        return output_logprobs(rows, head.weight, targets, chunk_size, head.bias)

    head.forward = logprobs_head  # for this call only: the model's forward (and its
    try:                          # FSDP hooks) runs as usual, its head gives logprobs
        values = model(**inputs, use_cache=False).logits
    finally:
        del head.forward
    return out.index_put(index, values.float())


def output_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int,
                    bias: Tensor | None = None) -> Tensor:
    """``log softmax(hidden @ weight^T + bias)[targets]`` per row, memory-bounded: Liger's
    fused kernel on CUDA when a fixed version is installed, else
    :func:`chunked_token_logprobs`."""
    if hidden.is_cuda and liger_available():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, hidden, targets, bias)
        return -(loss[0] if isinstance(loss, tuple) else loss).float()
    return chunked_token_logprobs(hidden, weight, targets, chunk_size=chunk_size, bias=bias)


def liger_available() -> bool:
    if importlib.util.find_spec("liger_kernel") is None:
        return False
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return False
    numbers = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    return numbers >= LIGER_MIN_VERSION


def _plain_output_projection(model: torch.nn.Module) -> bool:
    """Whether the logits are the output embedding's output, untouched (no soft-capping or
    scaling after it), so the head can be replaced by a logprob computation."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return False
    return not any(getattr(config, name, None) for name in (
        "final_logit_softcapping", "logit_scale", "output_multiplier_scale"))


VARLEN_SDPA = "lachesis_varlen_sdpa"
"""transformers attention implementation (registered on import) for packed micro-batches
without flash-attn: one causal SDPA call per row."""


def _varlen_sdpa(module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                 dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """Attention of a packed ``[1, heads, N, d]`` batch row by row: with
    ``cu_seq_lens_q = [0, l_1, l_1 + l_2, ...]`` (from :func:`sequence_logprobs`), row
    ``i`` is ``causal_sdpa(q[s_i:e_i], k[s_i:e_i], v[s_i:e_i])``, so each token sees its
    own row only, at a cost of ``sum_i l_i^2`` instead of the ``N^2`` of a block-diagonal
    mask. Without row boundaries (a padded batch) it is transformers' SDPA. transformers
    builds no mask for this implementation, so a padded batch runs causal without a
    padding mask: exact for right-padded rows, whose real tokens precede their padding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
        kwargs.pop(name, None)
    if bounds is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    edges = _row_edges(bounds)
    rows = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                   None, dropout=dropout, scaling=scaling, is_causal=True)[0]
            for s, e in itertools.pairwise(edges) if e > s]
    return torch.cat(rows, dim=1), None


_ROW_EDGES: dict[int, tuple[Tensor, list[int]]] = {}


def _remember_row_edges(bounds: Tensor, edges: list[int]) -> None:
    """Keep ``bounds``' values as Python ints for :func:`_varlen_sdpa`: reading a GPU
    tensor on the host waits for every queued kernel, and done in every layer's attention
    it left the GPU idle while the host queued the next layer (docs/benchmarks-gpu.md has the
    H200 figures). The last few are kept (the tensor with them, so its id is not
    reused), enough for a backward that recomputes checkpointed layers."""
    _ROW_EDGES[id(bounds)] = (bounds, edges)
    while len(_ROW_EDGES) > 8:
        del _ROW_EDGES[next(iter(_ROW_EDGES))]


def _row_edges(bounds: Tensor) -> list[int]:
    kept = _ROW_EDGES.get(id(bounds))
    if kept is not None and kept[0] is bounds:
        return kept[1]
    edges = bounds.tolist()
    _remember_row_edges(bounds, edges)
    return edges


def _register_varlen_sdpa() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, _varlen_sdpa)


_register_varlen_sdpa()


def attention_implementation(device: torch.device, dtype: torch.dtype,
                             packing: bool = True) -> str | None:
    """The attention for the trainer's model: with packing, ``flash_attention_2``
    (variable-length kernels) on CUDA with a half-precision model when ``flash-attn`` is
    installed, else :data:`VARLEN_SDPA`; without packing, None (transformers' default,
    SDPA with a padding mask)."""
    if not packing:
        return None
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) \
            and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return VARLEN_SDPA


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them
    (transformers' per-layer gradient checkpointing, non-reentrant, so it composes with
    FSDP2's per-layer sharding): activation memory drops from ~all layers' to ~one layer's
    plus the layer inputs, for one more forward pass."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
