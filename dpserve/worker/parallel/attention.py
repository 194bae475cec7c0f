"""Sequence-parallel attention: Ulysses all-to-all, ring K/V passing, and their product.

Tensors are laid out as diffusers' attention processors hold them, ``(batch,
sequence, heads, head_dim)``; each rank holds its own slice of the sequence.

- **Ulysses** (``ulysses`` ranks): an all-to-all trades sequence for heads, so each
  rank holds the whole (ulysses) sequence for ``heads / ulysses`` heads, attends,
  and a second all-to-all gives every rank its own tokens back for every head.
- **Ring** (``ring`` ranks): queries stay put; K/V blocks travel around the ring,
  one hop per step, while each rank attends its queries to the block it holds.
  The partial results merge exactly by log-sum-exp.
- Both: Ulysses inside, ring outside (``sp = ulysses * ring``); the ring then
  passes the Ulysses-gathered blocks.

Attention is permutation-invariant over keys, so the order in which blocks
arrive does not matter; rotary embeddings are applied before any exchange.

A key mask (``key_mask``, one flag per local key, False: never attended to, like
padded text tokens) travels with its keys: Ulysses gathers it as it gathers the
sequence, the ring passes it on with each K/V block. Where every batch row has the
same mask (one prompt), masked keys are dropped before attending, so the kernels
run unmasked; otherwise they are masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpserve.worker.parallel.tensor import gather_cat

# CUDA half-precision attention that also returns the log-sum-exp (flash kernel).
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SequenceGroups:
    """The process groups one rank's attention exchanges with (None: degree 1)."""

    ulysses: dist.ProcessGroup | None = None
    ring: dist.ProcessGroup | None = None
    # The ring's global ranks in ring order, and this rank's index among them.
    ring_ranks: tuple[int, ...] = ()
    ring_index: int = 0


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, S_local, H, D) -> (B, U * S_local, H / U, D): gather the sequence, scatter heads."""
    u = dist.get_world_size(group)
    b, s, h, d = x.shape
    # Chunk j of the heads goes to rank j; what arrives from rank j is its tokens.
    send = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`."""
    u = dist.get_world_size(group)
    b, su, hu, d = x.shape
    s = su // u
    send = x.reshape(b, u, s, hu, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, u * hu, d)


def _shared_keys(
    k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(B, H, S, D) keys and values without the masked ones where every row masks the
    same keys (the mask is then spent: None); unchanged, mask and all, otherwise."""
    if key_mask is None:
        return k, v, None
    if bool((key_mask == key_mask[:1]).all()):
        keep = key_mask[0].nonzero().squeeze(-1)
        return k.index_select(2, keep), v.index_select(2, keep), None
    return k, v, key_mask


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, S, D) tensors and the log-sum-exp of its scores, (B, H, S);
    ``key_mask`` (B, S_k), False for keys no query attends to.

    On CUDA in half precision, the flash kernel returns both; elsewhere (and for masks
    that differ between rows) the exact math runs in float32 (slow, and the reference
    the tests hold ring to). With no key left, the output is zero and the
    log-sum-exp -inf: merging it changes nothing.
    """
    k, v, key_mask = _shared_keys(k, v, key_mask)
    if k.shape[2] == 0:
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        return torch.zeros_like(q), lse
    if q.is_cuda and q.dtype in _FLASH_DTYPES and key_mask is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if key_mask is not None:
        # The least float rather than -inf: a row with every key masked stays finite.
        fill = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(~key_mask[:, None, None, :], fill)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets (float32 accumulators)."""
    new_lse = torch.logaddexp(lse, block_lse)
    merged = (
        torch.exp(lse - new_lse).unsqueeze(-1) * out
        + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out.float()
    )
    return merged, new_lse


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: SequenceGroups,
    scale: float,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, H, S, D) attention of local queries over every ring rank's keys and values
    (and their masks, (B, S), when ``key_mask`` is given)."""
    n = len(groups.ring_ranks)
    send_to = groups.ring_ranks[(groups.ring_index + 1) % n]
    recv_from = groups.ring_ranks[(groups.ring_index - 1) % n]
    kv = torch.stack((k, v)).contiguous()
    # Masks travel as bytes (gloo's point-to-point has no bool).
    mask = None if key_mask is None else key_mask.to(torch.uint8).contiguous()
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(n):
        pending = []
        if step < n - 1:  # pass the block on while attending to it
            incoming = torch.empty_like(kv)
            ops = [
                dist.P2POp(dist.isend, kv, send_to, groups.ring),
                dist.P2POp(dist.irecv, incoming, recv_from, groups.ring),
            ]
            if mask is not None:
                incoming_mask = torch.empty_like(mask)
                ops += [
                    dist.P2POp(dist.isend, mask, send_to, groups.ring),
                    dist.P2POp(dist.irecv, incoming_mask, recv_from, groups.ring),
                ]
            pending = dist.batch_isend_irecv(ops)
        block_mask = None if mask is None else mask.bool()
        block_out, block_lse = attention_with_lse(q, kv[0], kv[1], scale, block_mask)
        if out is None or lse is None:
            out, lse = block_out.float(), block_lse
        else:
            out, lse = _merge(out, lse, block_out, block_lse)
        for work in pending:
            work.wait()
        if step < n - 1:
            kv = incoming
            if mask is not None:
                mask = incoming_mask
    assert out is not None
    return out.to(q.dtype)


def parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    groups: SequenceGroups,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the whole sequence of (B, S_local, H, D) slices; returns the same shape.

    ``key_mask`` (B, S_local), where given: False for this rank's keys that no query
    attends to (module docstring).
    """
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if groups.ulysses is not None:
        query, key, value = (heads_to_sequence(x, groups.ulysses) for x in (query, key, value))
        if key_mask is not None:  # in the order heads_to_sequence gathers tokens: by rank
            key_mask = gather_cat(key_mask.to(torch.uint8), groups.ulysses, dim=1).bool()
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if _size(groups.ring) > 1:
        out = ring_attention(q, k, v, groups, scale, key_mask)
    else:
        k, v, key_mask = _shared_keys(k, v, key_mask)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2)
    if groups.ulysses is not None:
        out = sequence_to_heads(out.contiguous(), groups.ulysses)
    return out
