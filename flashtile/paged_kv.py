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
:func:`flashtile.decode.flash_attn_with_kvcache` reads the cache with; the Triton kernels do
the same mapping per key inside the kernel.
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
]

PAGE_SIZE_MULTIPLE = 16


def check_page_size(page_size: int) -> None:
    """Raise ``ValueError`` unless ``page_size`` is a positive multiple of 16."""
    if page_size <= 0 or page_size % PAGE_SIZE_MULTIPLE != 0:
        raise ValueError(
            f"paged k_cache/v_cache: page_size (dim 1 of the cache) must be a positive multiple of "
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
