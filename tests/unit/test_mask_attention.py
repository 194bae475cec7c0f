"""Attention with a key mask (Qwen-Image's padded text): the pieces, and the exchanges
(Ulysses, ring, both) on real gloo gangs against one whole masked attention."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dpserve.worker.parallel.attention import _merge, attention_with_lse  # noqa: E402

F = torch.nn.functional
B, H, S, D = 2, 4, 8, 8  # S tokens per rank


def _inputs(ranks: int) -> tuple[torch.Tensor, ...]:
    """(B, ranks * S, H, D) q, k, v and a (B, ranks * S) mask: the rows mask different
    keys, and the last rank's keys are all masked in row 0."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, ranks * S, H, D, generator=gen) for _ in range(3))
    mask = torch.rand(B, ranks * S, generator=gen) > 0.3
    mask[:, 0] = True
    if ranks > 1:
        mask[0, -S:] = False
    return q, k, v, mask


def _whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask[:, None, None, :]
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("shared", [True, False], ids=["one-mask", "row-masks"])
def test_masked_blocks_merge_to_the_whole_masked_attention(shared: bool) -> None:
    q, k, v, mask = _inputs(2)
    if shared:
        mask = mask[:1].expand(B, -1)
    want = _whole(q, k, v, mask).transpose(1, 2)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    scale = D**-0.5
    first = attention_with_lse(q, k[:, :, :S], v[:, :, :S], scale, mask[:, :S])
    second = attention_with_lse(q, k[:, :, S:], v[:, :, S:], scale, mask[:, S:])
    merged, _ = _merge(first[0].float(), first[1], *second)
    assert torch.allclose(merged, want, atol=1e-6)


def test_a_block_with_every_key_masked_adds_nothing() -> None:
    q, k, v, _ = _inputs(1)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    none = torch.zeros(B, S, dtype=torch.bool)
    out, lse = attention_with_lse(q, k, v, D**-0.5, none)
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isinf(lse).all())
    whole = attention_with_lse(q, k, v, D**-0.5)
    merged, _ = _merge(whole[0].float(), whole[1], out, lse)
    assert torch.equal(merged, whole[0])


def _rank(rank: int, layout: tuple[int, int], store: str, out: str) -> None:
    import torch.distributed as dist

    from dpserve.worker.parallel.attention import SequenceGroups, parallel_attention

    ulysses, ring = layout
    size = ulysses * ring
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    # Ulysses inside (consecutive ranks), ring outside.
    u_groups = [dist.new_group([r * ulysses + i for i in range(ulysses)]) for r in range(ring)]
    r_members = [tuple(r * ulysses + i for r in range(ring)) for i in range(ulysses)]
    r_groups = [dist.new_group(list(m)) for m in r_members]
    mine = r_members[rank % ulysses]
    groups = SequenceGroups(
        u_groups[rank // ulysses] if ulysses > 1 else None,
        r_groups[rank % ulysses] if ring > 1 else None,
        mine if ring > 1 else (),
        mine.index(rank),
    )
    q, k, v, mask = _inputs(size)
    own = slice(rank * S, (rank + 1) * S)
    got = parallel_attention(q[:, own], k[:, own], v[:, own], groups, key_mask=mask[:, own])
    error = float((got - _whole(q, k, v, mask)[:, own]).abs().max())
    Path(out, f"{rank}").write_text(str(error))
    dist.destroy_process_group()


@pytest.mark.gang
@pytest.mark.parametrize("layout", [(2, 1), (1, 2), (2, 2)], ids=["ulysses2", "ring2", "u2xr2"])
def test_masked_keys_travel_with_their_tokens(layout: tuple[int, int]) -> None:
    from tests.parallel_harness import start_ranks

    size = layout[0] * layout[1]
    with tempfile.TemporaryDirectory(prefix="dpserve-mask-") as tmp:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        start_ranks(_rank, (layout, os.path.join(tmp, "store"), tmp), size)
        errors = [float(Path(tmp, str(r)).read_text()) for r in range(size)]
    assert max(errors) < 1e-5, errors
