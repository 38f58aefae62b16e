"""Paged KV-cache helpers: block tables, logical-to-physical slot mapping, gathers and scatters.

A paged cache stores keys (or values) as ``(num_blocks, page_size, nheads_k, headdim)``; a block
table ``(batch, max_blocks)`` int32 lists, for each batch row, the physical page that holds
logical positions ``[i * page_size, (i + 1) * page_size)``::

    logical position p of row b  ->  cache[block_table[b, p // page_size], p % page_size]

    block_table[b] = [ 7, 2, 9 ]          page_size = 4
    positions        0..3  4..7  8..11
    physical pages   7     2     9        (any order; pages may be shared between rows)

A row's capacity is ``max_blocks * page_size``.  Page sizes must be a multiple of
:data:`PAGE_SIZE_MULTIPLE` (16) so that a kernel tile of 16 keys never straddles two pages
at an unaligned offset.

Everything here is plain PyTorch (any device).  The gathers are what the torch backend of
:func:`flashtile.kvcache.flash_attn_with_kvcache` reads the cache with; the Triton kernels do
the same mapping per key inside the kernel.

Varlen calls with ``block_table`` (:func:`flashtile.flash_attn_varlen_func`) number the keys of
all sequences one after another as ``cu_seqlens_k`` describes; :func:`varlen_slots` maps that
packed numbering to flat slots of the page pool, :func:`gather_varlen` packs the keys and
:func:`scatter_add_varlen` adds packed gradients back into the paged layout.
"""
from __future__ import annotations

import torch

__all__ = [
    "PAGE_SIZE_MULTIPLE",
    "check_page_size",
    "row_capacity",
    "slots_for_positions",
    "gather_kv",
    "scatter_kv",
    "paged_to_contiguous",
    "contiguous_to_paged",
    "varlen_slots",
    "gather_varlen",
    "scatter_add_varlen",
]

PAGE_SIZE_MULTIPLE = 16


def check_page_size(page_size: int, name: str = "paged k_cache/v_cache") -> None:
    """Raise :class:`flashtile.FlashtileInputError` (a ``ValueError``) unless ``page_size`` is
    a positive multiple of 16; ``name`` says which arguments hold the pages."""
    if page_size <= 0 or page_size % PAGE_SIZE_MULTIPLE != 0:
        from ._validate import FlashtileInputError  # _validate imports this module

        raise FlashtileInputError(
            f"{name}: page_size (dim 1 of the cache) must be a positive multiple of "
            f"{PAGE_SIZE_MULTIPLE}, got {page_size}"
        )


def row_capacity(cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Number of key slots one batch row can address.

    Contiguous cache ``(batch_cache, seqlen_cache, Hk, D)``: ``seqlen_cache``.
    Paged cache ``(num_blocks, page_size, Hk, D)`` with ``block_table (B, max_blocks)``:
    ``max_blocks * page_size``.
    """
    if block_table is None:
        return int(cache.shape[1])
    return int(block_table.shape[1]) * int(cache.shape[1])


def slots_for_positions(block_table_row: torch.Tensor, positions: torch.Tensor, page_size: int):
    """Map logical positions of one row to ``(page, offset)`` index tensors (int64).

    ``block_table_row``: ``(max_blocks,)`` int32; ``positions``: any-shaped integer tensor.
    """
    positions = positions.to(torch.int64)
    pages = block_table_row.to(torch.int64)[positions // page_size]
    return pages, positions % page_size


def gather_kv(
    cache: torch.Tensor,
    start: int,
    end: int,
    *,
    row: int,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keys (or values) at logical positions ``[start, end)`` of one row: ``(end - start, Hk, D)``.

    ``row`` is the cache row for a contiguous cache (already mapped through
    ``cache_batch_idx``) and the batch row of ``block_table`` for a paged cache.  Returns a view
    for a contiguous cache and a gathered copy for a paged one.
    """
    if end <= start:
        return cache.new_empty((0,) + tuple(cache.shape[2:]))
    if block_table is None:
        return cache[row, start:end]
    positions = torch.arange(start, end, device=cache.device)
    pages, offsets = slots_for_positions(block_table[row], positions, int(cache.shape[1]))
    return cache[pages, offsets]


def scatter_kv(
    cache: torch.Tensor,
    values: torch.Tensor,
    start: int,
    *,
    row: int,
    block_table: torch.Tensor | None = None,
) -> None:
    """Write ``values (n, Hk, D)`` into logical positions ``[start, start + n)`` of one row, in place."""
    n = int(values.shape[0])
    if n == 0:
        return
    values = values.to(cache.dtype)
    if block_table is None:
        cache[row, start:start + n] = values
        return
    positions = torch.arange(start, start + n, device=cache.device)
    pages, offsets = slots_for_positions(block_table[row], positions, int(cache.shape[1]))
    cache[pages, offsets] = values


def paged_to_contiguous(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Gather every row of a paged cache into ``(B, max_blocks * page_size, Hk, D)`` (a copy).

    Entries of ``block_table`` must all be valid page indices.
    """
    b, max_blocks = block_table.shape
    page_size = int(cache.shape[1])
    pages = cache[block_table.to(torch.int64).reshape(-1)]  # (B * max_blocks, page_size, Hk, D)
    return pages.reshape(b, max_blocks * page_size, *cache.shape[2:])


def contiguous_to_paged(
    cache: torch.Tensor,
    page_size: int,
    *,
    num_blocks: int | None = None,
    generator: torch.Generator | None = None,
):
    """Spread a contiguous cache ``(B, S, Hk, D)`` over randomly ordered pages.

    ``S`` must be a multiple of ``page_size``.  Returns ``(paged_cache, block_table)`` with
    ``paged_cache (num_blocks, page_size, Hk, D)`` (``num_blocks`` defaults to the number of
    pages needed; extra pages are filled with NaN so that reading them is detectable) and
    ``block_table (B, S // page_size)`` int32 on the cache's device.
    """
    check_page_size(page_size)
    b, s = int(cache.shape[0]), int(cache.shape[1])
    if s % page_size:
        raise ValueError(f"contiguous_to_paged: seqlen {s} is not a multiple of page_size {page_size}")
    per_row = s // page_size
    needed = b * per_row
    num_blocks = needed if num_blocks is None else int(num_blocks)
    if num_blocks < needed:
        raise ValueError(f"contiguous_to_paged: num_blocks={num_blocks} < {needed} pages needed")
    perm = torch.randperm(num_blocks, generator=generator)[:needed].to(cache.device)
    paged = cache.new_full((num_blocks, page_size) + tuple(cache.shape[2:]), float("nan"))
    paged[perm] = cache.reshape(needed, page_size, *cache.shape[2:])
    block_table = perm.reshape(b, per_row).to(torch.int32)
    return paged, block_table


def varlen_slots(block_table: torch.Tensor, cu_seqlens_k: torch.Tensor, page_size: int,
                 total_k: int | None = None) -> torch.Tensor:
    """Flat slot (``page * page_size + offset``) of every packed key, int64 ``(total_k,)``.

    Key ``t`` of the packed numbering belongs to sequence ``b`` with
    ``cu_seqlens_k[b] <= t < cu_seqlens_k[b + 1]`` and sits at local position
    ``j = t - cu_seqlens_k[b]``, i.e. in ``block_table[b, j // page_size]`` at offset
    ``j % page_size``.  Device ops only, apart from reading ``total_k = cu_seqlens_k[-1]``
    when it is not given.
    """
    cu = cu_seqlens_k.to(torch.int64)
    if total_k is None:
        total_k = int(cu[-1])
    t = torch.arange(total_k, device=cu.device)
    b = torch.searchsorted(cu[1:], t, right=True)  # sequence of each packed key
    j = t - cu[b]
    pages = block_table.to(torch.int64)[b, j // page_size]
    return pages * page_size + j % page_size


def gather_varlen(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The keys (or values) at ``slots`` of a page pool ``(num_blocks, page_size, Hk, D)``,
    packed as ``(len(slots), Hk, D)`` (a copy)."""
    page_size = int(cache.shape[1])
    return cache[slots // page_size, slots % page_size]


def scatter_add_varlen(grad: torch.Tensor, slots: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Packed gradients ``(len(slots), Hk, D)`` added into a zero pool shaped like ``like``.

    Slots no key maps to get 0; a slot reached by several keys (a page shared by two
    sequences) gets their sum, accumulated in float32 in increasing packed order and then cast
    to ``like``'s dtype.  Deterministic on every device: the sum runs in rounds, round ``r``
    adding the ``r``-th key of every slot, so no round writes a slot twice (no atomics, and
    only one round when no page is shared).
    """
    n = int(like.shape[0]) * int(like.shape[1])
    acc = torch.zeros((n,) + tuple(like.shape[2:]), dtype=torch.float32, device=like.device)
    if slots.numel():
        grad = grad.to(torch.float32)
        # rank of each key among the keys of its slot, in packed order (stable sort)
        sorted_slots, order = torch.sort(slots, stable=True)
        pos = torch.arange(slots.numel(), device=slots.device)
        first = torch.ones_like(sorted_slots, dtype=torch.bool)
        first[1:] = sorted_slots[1:] != sorted_slots[:-1]
        start = torch.where(first, pos, torch.zeros_like(pos)).cummax(0).values
        rank = torch.empty_like(pos)
        rank[order] = pos - start
        for r in range(int(rank.max()) + 1):
            sel = rank == r
            acc[slots[sel]] += grad[sel]
    return acc.view(like.shape).to(like.dtype)
