"""Variant benchmarks: block-sparse density, sliding window, varlen and padded batches, each
against its dense call.

Run it as ``python -m flashtile.bench variants [flags]`` (or ``flashtile bench variants``)::

    python -m flashtile.bench variants                              # every sweep, device defaults
    python -m flashtile.bench variants --sweeps sparse window --flex
    python -m flashtile.bench variants --device cpu --quick         # small sizes, torch backend

Sweeps (``--sweeps``, all by default), on one shared ``(B, N, H, d)`` input set:

``sparse``
    ``block_sparse_attn_func`` with a random ``(N / bs) x (N / bs)`` block mask of density
    1, 1/2, 1/4, 1/8, 1/16 (``--densities``; the diagonal blocks are always kept, so the measured
    density, recorded as ``param``, is a little above the target), against the dense non-causal
    ``flash_attn_func``.  Zero blocks are never loaded, so the time should fall with the density.
``window``
    ``flash_attn_func(causal=True, window_size=(w, 0))`` for w = N/32, N/8, N/2, N
    (``--windows``), against the dense causal call.
``varlen``
    ``B * N`` tokens in sequences of random length (uniform in [m/4, 7m/4), mean m = N/8 by
    default) packed through ``flash_attn_varlen_func``, against the same sequences padded to the
    longest through ``flash_attn_func``; non-causal and causal.  ``varlen_paged`` is the packed
    call with the keys / values in a paged pool (``block_table``, pages of ``PAGE_SIZE`` = 256
    slots in random order).
``padding``
    a padded batch: row ``r`` of ``B`` padded on the left by ``f * N * (r + 1) / B`` keys for
    pad fractions f = 1/8, 1/4, 1/2 (``--pad-fractions``), the padding given as a
    ``(B, 1, 1, N)`` bool key mask (how transformers and SDPA callers pass it), against the
    same call without a mask; non-causal and causal.  flashtile runs
    ``flashtile.autograd.attention`` with the mask as ``attn_bias`` (what the transformers
    integration calls); ``sdpa`` gets the mask, combined with the causal mask into a
    ``(B, 1, N, N)`` one when causal (``attn_mask`` cannot be combined with ``is_causal``).

Peers: ``sdpa`` (PyTorch's default SDPA dispatch) runs the window sweep with a dense bool mask,
against its own ``is_causal=True`` call, and the padding sweep; ``flex`` (``--flex``; CUDA only, skipped on CPU) runs the
sparse and window sweeps as ``torch.compile(flex_attention)`` with a ``create_block_mask`` block
mask (the same random blocks, or the band), against its own unmasked / causal call.
``flashtile_portable`` runs every sweep flashtile runs with ``FLASHTILE_SM90=0`` (the portable
Triton kernels where the Hopper ones would run): an A/B of the two in one process, e.g.
``--sweeps varlen --impl flashtile flashtile_portable``.

Each (variant, parameter, causal) is timed in each ``--mode`` (``fwd`` and ``fwd_bwd`` by
default) with ``flashtile.bench``'s timers and its error classification.  A record is::

    {sweep, impl, mode, variant, param, causal, dtype, d, n, batch, heads, ms, tflops,
     ratio_vs_dense, status, error, detail, device, torch, triton, date}

``variant`` is ``dense``, ``block_sparse``, ``window``, ``varlen``, ``varlen_paged``, ``padded``
or ``key_mask``; ``param`` the measured density, the window ``w``, the mean sequence length, or
the pad fraction (None for ``dense``).
``ratio_vs_dense`` is ``ms`` over the ``ms`` of the reference call of the same sweep, impl, mode
and causal setting: the dense non-causal call for ``block_sparse``, the dense causal call for
``window``, the padded call for ``varlen`` (1.0 on the references themselves).  Below 1 is faster
than the reference; for block-sparse it should approach the density.  ``detail`` holds the
target value (``target``) and, for block-sparse, the block size and the kept / total block
counts; for varlen and padded the sequence count, token count and longest length.

``tflops`` counts useful FLOPs only, ``4 * d * P * heads`` per forward (times
``MODES[mode].flops_mult``: 3.5 for fwd_bwd) where ``P`` is the number of visible (query, key)
pairs:

* dense: ``B * N^2``, halved when causal (the FlashAttention convention of ``flashtile.bench``,
  which counts the diagonal at half weight);
* block-sparse: ``B *`` the sum, over the kept blocks, of the block's rows x columns (the
  visible blocks; zero blocks count nothing);
* window ``(w, 0)``: ``B * (N * (w + 1/2) - w * (w + 1) / 2)`` for ``w < N`` (the band, diagonal
  at half weight as for causal; ``w >= N`` is the causal count ``B * N^2 / 2``);
* varlen and padded: the sum over the sequences of ``len^2`` (halved when causal); the padded
  call gets no credit for its padding;
* key_mask: the same over the rows' unpadded lengths (queries of padding count nothing).

The run merges its records into the device's results file (``benchmarks/results/<device>.json``,
entry ``variants``), prints a table, and draws ``sparse.png``, ``window.png``, ``varlen.png`` and
``padding.png`` into ``--plots`` unless ``--no-plot``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.nn.functional as F

from . import common, report
from .common import Inputs, Prepared

__all__ = [
    "IMPLS", "RECORD_KEYS", "SWEEPS", "VariantCase", "VariantsConfig", "build_plan", "main",
    "parse_args", "plot", "render_table", "run_variants", "varlen_lengths", "variant_key",
]

RECORD_KEYS = ("sweep", "impl", "mode", "variant", "param", "causal", "dtype", "d", "n", "batch",
               "heads", "ms", "tflops", "ratio_vs_dense", "status", "error", "detail", "device",
               "torch", "triton", "date")
SWEEPS = ("sparse", "window", "varlen", "padding")
# page size of the paged-KV varlen variant (flash-attn's paged KV needs multiples of 256)
PAGE_SIZE = 256
# flashtile_portable: flashtile with FLASHTILE_SM90=0 (the portable Triton kernels where the
# Hopper ones would run), in the same process as flashtile's cases: an A/B of the two kernels
IMPLS = ("flashtile", "sdpa", "flex", "flashtile_portable")
_FLASHTILE = ("flashtile", "flashtile_portable")
KEY = "variants"  # the entry of the results file that holds the variants records
DENSITIES = (Fraction(1), Fraction(1, 2), Fraction(1, 4), Fraction(1, 8), Fraction(1, 16))
PAD_FRACTIONS = (Fraction(1, 8), Fraction(1, 4), Fraction(1, 2))
# the reference variant of each sweep (the sweep's causal setting picks its dense call)
_REFERENCE = {"sparse": "dense", "window": "dense", "varlen": "padded", "padding": "dense"}


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Sizes:
    n: int
    batch: int
    heads: int
    d: int
    dtype: str
    block_size: int
    warmup: float
    rep: float


PRESETS: dict[tuple[str, bool], _Sizes] = {
    ("cuda", False): _Sizes(8192, 2, 16, 128, "bf16", 128, 25, 100),
    ("cuda", True): _Sizes(4096, 2, 16, 128, "bf16", 128, 10, 40),
    ("cpu", False): _Sizes(512, 2, 2, 32, "fp32", 32, 0, 20),
    ("cpu", True): _Sizes(256, 1, 2, 32, "fp32", 32, 0, 5),
}


@dataclasses.dataclass(frozen=True)
class VariantsConfig(common.RunOptions):
    """One run; ``windows``, ``varlen_mean`` and ``varlen_tokens`` default to N/32, N/8, N/2, N;
    N/8; and B*N. Bad values raise ValueError naming the field."""

    device: str
    sweeps: tuple[str, ...] = SWEEPS
    impls: tuple[str, ...] = ("flashtile", "sdpa")
    modes: tuple[str, ...] = ("fwd", "fwd_bwd")
    n: int = 8192
    batch: int = 2
    heads: int = 16
    d: int = 128
    dtype: str = "bf16"
    block_size: int = 128
    densities: tuple[Fraction, ...] = DENSITIES
    pad_fractions: tuple[Fraction, ...] = PAD_FRACTIONS
    windows: tuple[int, ...] | None = None
    varlen_mean: int | None = None
    varlen_tokens: int | None = None
    warmup: float = 25
    rep: float = 100

    def __post_init__(self):
        def bad(field: str, msg: str):
            raise ValueError(f"{field}: {msg}")

        for field, allowed in (("sweeps", SWEEPS), ("impls", IMPLS), ("modes", tuple(common.MODES))):
            values = getattr(self, field)
            if not values:
                bad(field, "empty")
            unknown = [v for v in values if v not in allowed]
            if unknown:
                bad(field, f"unknown {unknown[0]!r}; choose from {', '.join(allowed)}")
        if self.device not in ("cpu", "cuda"):
            bad("device", f"{self.device!r} is neither cpu nor cuda")
        if self.dtype not in common.DTYPES:
            bad("dtype", f"unknown {self.dtype!r}; choose from {', '.join(common.DTYPES)}")
        for field in ("n", "batch", "heads", "d", "block_size"):
            if getattr(self, field) <= 0:
                bad(field, f"must be positive, got {getattr(self, field)}")
        if self.block_size % 16 or self.block_size > self.n:
            bad("block_size", f"{self.block_size} must be a multiple of 16 and at most n={self.n}")
        if not self.densities or any(not 0 < x <= 1 for x in self.densities):
            bad("densities", f"each must be in (0, 1], got {[str(x) for x in self.densities]}")
        if not self.pad_fractions or any(not 0 < x < 1 for x in self.pad_fractions):
            bad("pad_fractions", f"each must be in (0, 1), got "
                                 f"{[str(x) for x in self.pad_fractions]}")
        if self.windows is not None and (not self.windows or
                                         any(not 0 < w <= self.n for w in self.windows)):
            bad("windows", f"each must be in [1, n={self.n}], got {list(self.windows)}")
        if self.varlen_mean is not None and self.varlen_mean < 4:
            bad("varlen_mean", f"must be at least 4, got {self.varlen_mean}")
        if self.varlen_tokens is not None and self.varlen_tokens < self.mean_length():
            bad("varlen_tokens", f"{self.varlen_tokens} is less than the mean length "
                                 f"{self.mean_length()}")
        if self.warmup < 0 or self.rep < 0:
            bad("warmup" if self.warmup < 0 else "rep", "must not be negative")

    def window_sizes(self) -> tuple[int, ...]:
        if self.windows is not None:
            return self.windows
        return tuple(dict.fromkeys(max(1, self.n // k) for k in (32, 8, 2, 1)))

    def mean_length(self) -> int:
        return self.varlen_mean if self.varlen_mean is not None else max(4, self.n // 8)

    def total_tokens(self) -> int:
        return self.varlen_tokens if self.varlen_tokens is not None else self.batch * self.n


def _density(text: str, what: str = "density", one: bool = True) -> Fraction:
    """``"0.5"``, ``"1/8"`` -> Fraction in (0, 1] (``one``: 1 allowed)."""
    try:
        value = Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (e.g. 0.25 or 1/4)") from None
    if not (0 < value <= 1 if one else 0 < value < 1):
        raise argparse.ArgumentTypeError(f"{what} {text!r} is not in (0, {1 if one else '1)'}"
                                         f"{']' if one else ''}")
    return value


def _pad_fraction(text: str) -> Fraction:
    return _density(text, "pad fraction", one=False)


def variants_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench variants",
        description="Block-sparse density, sliding-window and varlen sweeps, each against its "
                    "dense call (see flashtile/bench/variants.py). Unset sizes come from the "
                    "device's preset: B=2, N=8K, H=16, d=128, bf16 on CUDA; B=2, N=512, H=2, "
                    "d=32, fp32 on CPU (--quick: smaller).")
    p.add_argument("--sweeps", nargs="+", default=None, metavar="SWEEP",
                   help=f"any of {', '.join(SWEEPS)}, or all (default all)")
    p.add_argument("--impl", nargs="+", default=None, metavar="NAME",
                   help=f"any of {', '.join(IMPLS)}, or all (default flashtile sdpa)")
    p.add_argument("--flex", action="store_true",
                   help="add compiled FlexAttention with block masks (CUDA only)")
    p.add_argument("--mode", nargs="+", default=None, metavar="MODE",
                   help=f"any of {', '.join(common.MODES)}, or all (default fwd fwd_bwd)")
    p.add_argument("--n", type=common.parse_seqlen, default=None, help="sequence length, e.g. 8K")
    p.add_argument("--batch", type=common.positive_int, default=None)
    p.add_argument("--heads", type=common.positive_int, default=None)
    p.add_argument("--d", type=common.positive_int, default=None, help="head dim")
    p.add_argument("--dtype", type=common.parse_dtype, default=None,
                   help=f"one of {', '.join(common.DTYPES)}")
    p.add_argument("--block-size", type=common.positive_int, default=None,
                   help="block-sparse block size, a multiple of 16 (default 128 on CUDA)")
    p.add_argument("--densities", nargs="+", type=_density, default=None, metavar="X",
                   help="target block densities (default 1 1/2 1/4 1/8 1/16)")
    p.add_argument("--pad-fractions", nargs="+", type=_pad_fraction, default=None, metavar="F",
                   help="padding sweep: row r of B padded by F * N * (r + 1) / B keys "
                        "(default 1/8 1/4 1/2)")
    p.add_argument("--windows", nargs="+", type=common.parse_seqlen, default=None, metavar="W",
                   help="window sizes w of window_size=(w, 0) (default N/32 N/8 N/2 N)")
    p.add_argument("--varlen-mean", type=common.parse_seqlen, default=None, metavar="M",
                   help="mean varlen sequence length (default N/8)")
    p.add_argument("--varlen-tokens", type=common.parse_seqlen, default=None, metavar="T",
                   help="tokens packed in the varlen batch (default B*N)")
    p.add_argument("--quick", action="store_true", help="smaller preset (N=4K on CUDA)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up ms (default 25 on CUDA)")
    p.add_argument("--rep", type=float, default=None, help="measured ms (default 100 on CUDA)")
    common.common_arguments(p, KEY, "the plots")
    return p


def parse_args(argv: Sequence[str] | None = None) -> VariantsConfig:
    p = variants_parser()
    a = p.parse_args(argv)
    names = {}
    for flag, values, allowed, what in (("sweeps", a.sweeps, SWEEPS, "sweep"),
                                        ("impl", a.impl, IMPLS, "implementation"),
                                        ("mode", a.mode, list(common.MODES), "mode")):
        try:
            names[flag] = common.parse_names(values, allowed, what)
        except argparse.ArgumentTypeError as exc:
            p.error(f"argument --{flag}: {exc}")
    sweeps, impls, modes = names["sweeps"], names["impl"], names["mode"]
    impls = impls or VariantsConfig.impls
    if a.flex and "flex" not in impls:
        impls += ("flex",)
    device = a.device or common.default_device()
    sizes = PRESETS[(device, bool(a.quick))]

    def pick(value, default):
        return default if value is None else value

    try:
        return VariantsConfig(
            device=device, sweeps=sweeps or SWEEPS, impls=impls, modes=modes or ("fwd", "fwd_bwd"),
            n=pick(a.n, sizes.n), batch=pick(a.batch, sizes.batch), heads=pick(a.heads, sizes.heads),
            d=pick(a.d, sizes.d), dtype=pick(a.dtype, sizes.dtype),
            block_size=pick(a.block_size, sizes.block_size),
            densities=tuple(dict.fromkeys(a.densities)) if a.densities else DENSITIES,
            pad_fractions=(tuple(dict.fromkeys(a.pad_fractions)) if a.pad_fractions
                           else PAD_FRACTIONS),
            windows=tuple(dict.fromkeys(a.windows)) if a.windows else None,
            varlen_mean=a.varlen_mean, varlen_tokens=a.varlen_tokens,
            warmup=pick(a.warmup, sizes.warmup), rep=pick(a.rep, sizes.rep), out=a.out,
            plots=a.plots, seed=a.seed, plot=a.plot, progress=a.progress,
            raise_errors=a.raise_errors)
    except ValueError as exc:
        field, _, msg = str(exc).partition(": ")
        flag = {"impls": "impl", "modes": "mode"}.get(field, field).replace("_", "-")
        p.error(f"argument --{flag}: {msg}")


# --------------------------------------------------------------------------------------------
# Useful FLOPs
# --------------------------------------------------------------------------------------------

def dense_pairs(n: int, causal: bool) -> Fraction:
    return Fraction(n * n, 2 if causal else 1)


def window_pairs(n: int, w: int) -> Fraction:
    """Visible pairs of causal ``window_size=(w, 0)``, the diagonal at half weight."""
    if w >= n:
        return dense_pairs(n, True)
    return n * (w + Fraction(1, 2)) - Fraction(w * (w + 1), 2)


def block_pairs(blocks: torch.Tensor, n: int, block_size: int) -> int:
    """Pairs inside the kept blocks of a ``(R, C)`` block mask over an ``n x n`` score matrix."""
    sizes = torch.full((blocks.shape[0],), block_size, dtype=torch.int64)
    sizes[-1] = n - block_size * (blocks.shape[0] - 1)
    return int((sizes[:, None] * sizes[None, :] * blocks.cpu().to(torch.int64)).sum())


def varlen_pairs(lengths: Sequence[int], causal: bool) -> Fraction:
    return sum((dense_pairs(s, causal) for s in lengths), Fraction(0))


def pad_lengths(n: int, batch: int, fraction: Fraction) -> list[int]:
    """Padded keys of each row of the padding sweep: row ``r`` gets ``fraction * n * (r + 1) /
    batch`` (rounded down)."""
    return [int(fraction * n * (r + 1) / batch) for r in range(batch)]


def _useful_flops(pairs: Fraction, heads: int, d: int, mode: str) -> int:
    return int(4 * d * heads * pairs * common.MODES[mode].flops_mult)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def random_blocks(n: int, block_size: int, density: Fraction, seed: int) -> torch.Tensor:
    """Bool ``(R, R)`` block mask, ``R = ceil(n / block_size)``: each block kept with probability
    ``density``, the diagonal always (on the CPU generator, so every device gets the same)."""
    nb = -(-n // block_size)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.rand(nb, nb, generator=gen) < float(density)
    return blocks | torch.eye(nb, dtype=torch.bool)


def varlen_lengths(tokens: int, mean: int, seed: int) -> list[int]:
    """Random lengths, uniform in ``[mean/4, 7 mean/4)``, drawn until they hold ``tokens``, then
    the last ones dropped until they fit."""
    lo = max(1, mean // 4)
    hi = max(lo + 1, 7 * mean // 4)
    count = max(64, -(-2 * tokens // lo))
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(lo, hi, (count,), generator=gen).tolist()
    while len(lengths) > 1 and sum(lengths) > tokens:
        lengths.pop()
    return lengths


@dataclasses.dataclass
class VarlenData:
    lengths: list[int]
    cu_seqlens: torch.Tensor
    packed: Inputs  # q, k, v, dout of shape (total, heads, d)
    padded: Inputs  # (sequences, longest, heads, d)

    @property
    def longest(self) -> int:
        return max(self.lengths)


def make_varlen_data(lengths: list[int], heads: int, d: int, dtype: str,
                     device: torch.device | str, seed: int) -> VarlenData:
    dt = common.DTYPES[dtype]
    torch.manual_seed(seed)
    total = sum(lengths)
    packed = Inputs(*(torch.randn(total, heads, d, dtype=dt, device=device) for _ in range(4)))
    padded = common.make_inputs(len(lengths), max(lengths), heads, d, dtype, device, seed + 1)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return VarlenData(lengths, cu, packed, padded)


# --------------------------------------------------------------------------------------------
# Implementations of each variant
# --------------------------------------------------------------------------------------------

def _leaves(inp: Inputs) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))


def _prepare_dense_flashtile(causal: bool) -> Callable[[Inputs], Prepared]:
    return lambda inp: common.IMPLS["flashtile"].prepare(inp, causal, inp.d ** -0.5)


def _prepare_block_sparse(blocks: torch.Tensor, block_size: int) -> Callable[[Inputs], Prepared]:
    def prepare(inp: Inputs) -> Prepared:
        from ..block_sparse import block_sparse_attn_func

        mask = blocks.to(inp.device)[None, None]
        q, k, v = _leaves(inp)

        def fn():
            return block_sparse_attn_func(q, k, v, mask, block_size=(block_size, block_size),
                                          softmax_scale=inp.d ** -0.5)
        return Prepared(fn, (q, k, v), inp.dout)
    return prepare


def _prepare_window_flashtile(w: int) -> Callable[[Inputs], Prepared]:
    def prepare(inp: Inputs) -> Prepared:
        ft = common.flashtile_api()
        q, k, v = _leaves(inp)

        def fn():
            return ft.flash_attn_func(q, k, v, softmax_scale=inp.d ** -0.5, causal=True,
                                      window_size=(w, 0))
        return Prepared(fn, (q, k, v), inp.dout)
    return prepare


def _prepare_dense_sdpa(causal: bool) -> Callable[[Inputs], Prepared]:
    return lambda inp: common.IMPLS["sdpa"].prepare(inp, causal, inp.d ** -0.5)


def _prepare_window_sdpa(w: int) -> Callable[[Inputs], Prepared]:
    def prepare(inp: Inputs) -> Prepared:
        from ..masks import visible_mask

        mask = visible_mask(inp.n, inp.n, window_left=w, window_right=0, device=inp.device)
        q, k, v = (common.bhnd(t).requires_grad_() for t in (inp.q, inp.k, inp.v))

        def fn():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=inp.d ** -0.5)
        return Prepared(fn, (q, k, v), common.bhnd(inp.dout))
    return prepare


def _prepare_varlen(causal: bool) -> Callable[[VarlenData], Prepared]:
    def prepare(data: VarlenData) -> Prepared:
        ft = common.flashtile_api()
        q, k, v = _leaves(data.packed)
        cu, longest, scale = data.cu_seqlens, data.longest, q.shape[-1] ** -0.5

        def fn():
            return ft.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                             softmax_scale=scale, causal=causal)
        return Prepared(fn, (q, k, v), data.packed.dout)
    return prepare


def paged_pools(data: VarlenData, page_size: int, seed: int):
    """The packed keys / values of ``data`` copied into page pools
    ``(num_pages, page_size, heads, d)``, the pages of all sequences in one random order, and
    the int32 block table ``(sequences, max_pages)`` that maps them back."""
    k, v = data.packed.k, data.packed.v
    pages = [-(-n // page_size) for n in data.lengths]
    gen = torch.Generator().manual_seed(seed + 2)
    order = torch.randperm(sum(pages), generator=gen)
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    pools = [torch.zeros(sum(pages), page_size, *k.shape[1:], dtype=k.dtype, device=k.device)
             for _ in range(2)]
    first = start = 0
    for b, (n, np_) in enumerate(zip(data.lengths, pages)):
        ids = order[first:first + np_]
        table[b, :np_] = ids.to(torch.int32)
        for pool, src in zip(pools, (k, v)):
            padded = torch.zeros(np_ * page_size, *k.shape[1:], dtype=k.dtype, device=k.device)
            padded[:n] = src[start:start + n]
            pool[ids.to(k.device)] = padded.view(np_, page_size, *k.shape[1:])
        first, start = first + np_, start + n
    return pools[0], pools[1], table.to(k.device)


def _prepare_varlen_paged(causal: bool, page_size: int, seed: int) -> Callable[[VarlenData], Prepared]:
    def prepare(data: VarlenData) -> Prepared:
        ft = common.flashtile_api()
        k_pool, v_pool, table = paged_pools(data, page_size, seed)
        q = data.packed.q.detach().requires_grad_()
        k_pool, v_pool = k_pool.requires_grad_(), v_pool.requires_grad_()
        cu, longest, scale = data.cu_seqlens, data.longest, q.shape[-1] ** -0.5

        def fn():
            return ft.flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, longest, longest,
                                             softmax_scale=scale, causal=causal,
                                             block_table=table)
        return Prepared(fn, (q, k_pool, v_pool), data.packed.dout)
    return prepare


def key_padding_mask(n: int, pads: Sequence[int], device) -> torch.Tensor:
    """``(B, 1, 1, n)`` bool: row ``r`` hides its first ``pads[r]`` keys (left padding)."""
    keys = torch.arange(n, device=device)
    return (keys[None, :] >= torch.tensor(pads, device=device)[:, None])[:, None, None, :]


def _prepare_key_mask_flashtile(pads: list[int], causal: bool) -> Callable[[Inputs], Prepared]:
    def prepare(inp: Inputs) -> Prepared:
        from ..autograd import attention
        from ..backends.spec import AttnSpec

        mask = key_padding_mask(inp.n, pads, inp.device)
        spec = AttnSpec(softmax_scale=inp.d ** -0.5, window_right=0 if causal else -1)
        q, k, v = _leaves(inp)

        def fn():
            return attention(q, k, v, spec, attn_bias=mask)[0]
        return Prepared(fn, (q, k, v), inp.dout)
    return prepare


def _prepare_key_mask_sdpa(pads: list[int], causal: bool) -> Callable[[Inputs], Prepared]:
    def prepare(inp: Inputs) -> Prepared:
        mask = key_padding_mask(inp.n, pads, inp.device)
        if causal:
            mask = mask & torch.ones(inp.n, inp.n, dtype=torch.bool, device=inp.device).tril()
        q, k, v = (common.bhnd(t).requires_grad_() for t in (inp.q, inp.k, inp.v))

        def fn():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=inp.d ** -0.5)
        return Prepared(fn, (q, k, v), common.bhnd(inp.dout))
    return prepare


def _prepare_padded(causal: bool) -> Callable[[VarlenData], Prepared]:
    return lambda data: _prepare_dense_flashtile(causal)(data.padded)


_FLEX: dict[str, Any] = {"key": None, "fn": None, "block_mask": None}


def reset_flex_cache() -> None:
    _FLEX.update(key=None, fn=None, block_mask=None)


def _flex_mask_mod(kind: str, value: Any, block_size: int):
    if kind == "causal":
        return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    if kind == "window":
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= value)
    return lambda b, h, q_idx, kv_idx: value[q_idx // block_size, kv_idx // block_size]


def _prepare_flex(kind: str, value: Any = None, block_size: int = 128) -> Callable[[Inputs],
                                                                                  Prepared]:
    """Compiled flex_attention with the block mask of ``kind`` (None: unmasked, "causal",
    "window" of ``value``, "blocks" of the ``(R, R)`` mask ``value``).  A new mask starts from a
    fresh dynamo state, so the modes of one mask share its compilation and the recompile limit
    is never reached."""
    def prepare(inp: Inputs) -> Prepared:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        key = (kind, value if kind != "blocks" else id(value), block_size, inp.batch, inp.n,
               inp.heads, inp.d, inp.q.dtype, str(inp.device))
        if _FLEX["key"] != key:
            reset_flex_cache()
            torch._dynamo.reset()
            block_mask = None
            if kind is not None:
                arg = value.to(inp.device) if kind == "blocks" else value
                block_mask = create_block_mask(_flex_mask_mod(kind, arg, block_size), None, None,
                                               inp.n, inp.n, device=inp.device,
                                               BLOCK_SIZE=block_size if kind == "blocks" else 128)
            _FLEX.update(key=key, fn=torch.compile(flex_attention, dynamic=False),
                         block_mask=block_mask)
        compiled, block_mask = _FLEX["fn"], _FLEX["block_mask"]
        q, k, v = (common.bhnd(t).requires_grad_() for t in (inp.q, inp.k, inp.v))

        def fn():
            return compiled(q, k, v, block_mask=block_mask, scale=inp.d ** -0.5)
        return Prepared(fn, (q, k, v), common.bhnd(inp.dout))
    return prepare


def _context(impl: str) -> Callable[[torch.device], ContextManager]:
    if impl == "flashtile":
        return common.flashtile_context
    if impl == "flashtile_portable":
        return common.flashtile_portable_context
    if impl == "flex":
        return common.flex_context
    return lambda device: contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VariantCase:
    """One timed call. ``data`` names the inputs it runs on ("dense": the shared ``Inputs``,
    "varlen": ``VarlenData``); ``pairs`` its visible (query, key) pairs over the whole batch."""

    sweep: str
    impl: str
    variant: str
    param: float | int | None
    causal: bool
    mode: str
    data: str
    pairs: Fraction
    prepare: Callable[[Any], Prepared] = dataclasses.field(compare=False, repr=False)
    detail: dict | None = dataclasses.field(default=None, compare=False)

    def label(self) -> str:
        param = "" if self.param is None else f" {_fmt_param(self.variant, self.param)}"
        return (f"{self.sweep}: {self.impl} {self.variant}{param} "
                f"{'causal' if self.causal else 'full'} {self.mode}")


def _fmt_param(variant: str, param) -> str:
    if param is None:
        return "-"
    if variant == "block_sparse":
        return f"{param:.3g}"
    if variant == "window":
        return report.format_n(int(param))
    return f"{param:.4g}"


def build_plan(cfg: VariantsConfig) -> list[VariantCase]:
    """Every case, sweep by sweep; within a sweep impl by impl, the reference first, and the
    modes of one variant/parameter back to back (FlexAttention compiles once per mask)."""
    impls = [i for i in cfg.impls if not (i == "flex" and cfg.device == "cpu")]
    b, n = cfg.batch, cfg.n
    plan: list[VariantCase] = []

    def add(sweep, impl, variant, param, causal, data, pairs, prepare, detail=None):
        for mode in cfg.modes:
            plan.append(VariantCase(sweep, impl, variant, param, causal, mode, data, pairs,
                                    prepare, detail))

    if "sparse" in cfg.sweeps:
        masks = [(x, random_blocks(n, cfg.block_size, x, cfg.seed + i))
                 for i, x in enumerate(cfg.densities)]
        for impl in (i for i in impls if i in (*_FLASHTILE, "flex")):
            dense = (_prepare_dense_flashtile(False) if impl in _FLASHTILE
                     else _prepare_flex(None))
            add("sparse", impl, "dense", None, False, "dense", b * dense_pairs(n, False), dense)
            for target, blocks in masks:
                pairs = b * block_pairs(blocks, n, cfg.block_size)
                detail = {"target": float(target), "block_size": cfg.block_size,
                          "kept_blocks": int(blocks.sum()), "blocks": blocks.numel()}
                prepare = (_prepare_block_sparse(blocks, cfg.block_size) if impl in _FLASHTILE
                           else _prepare_flex("blocks", blocks, cfg.block_size))
                add("sparse", impl, "block_sparse", float(pairs / (b * n * n)), False, "dense",
                    pairs, prepare, detail)
    if "window" in cfg.sweeps:
        for impl in impls:
            kind = "flashtile" if impl in _FLASHTILE else impl
            dense = {"flashtile": _prepare_dense_flashtile(True), "sdpa": _prepare_dense_sdpa(True),
                     "flex": _prepare_flex("causal")}[kind]
            add("window", impl, "dense", None, True, "dense", b * dense_pairs(n, True), dense)
            for w in cfg.window_sizes():
                prepare = {"flashtile": _prepare_window_flashtile, "sdpa": _prepare_window_sdpa,
                           "flex": lambda w: _prepare_flex("window", w)}[kind](w)
                add("window", impl, "window", w, True, "dense", b * window_pairs(n, w), prepare)
    if "varlen" in cfg.sweeps:
        lengths = varlen_lengths(cfg.total_tokens(), cfg.mean_length(), cfg.seed)
        mean = sum(lengths) / len(lengths)
        detail = {"target": cfg.mean_length(), "sequences": len(lengths), "tokens": sum(lengths),
                  "longest": max(lengths)}
        for impl in (i for i in impls if i in _FLASHTILE):
            for causal in (False, True):
                pairs = varlen_pairs(lengths, causal)
                add("varlen", impl, "padded", mean, causal, "varlen", pairs,
                    _prepare_padded(causal), detail)
                add("varlen", impl, "varlen", mean, causal, "varlen", pairs,
                    _prepare_varlen(causal), detail)
                add("varlen", impl, "varlen_paged", mean, causal, "varlen", pairs,
                    _prepare_varlen_paged(causal, PAGE_SIZE, cfg.seed),
                    dict(detail, page_size=PAGE_SIZE))
    if "padding" in cfg.sweeps:
        for impl in (i for i in impls if i in (*_FLASHTILE, "sdpa")):
            for causal in (False, True):
                dense = (_prepare_dense_flashtile(causal) if impl in _FLASHTILE
                         else _prepare_dense_sdpa(causal))
                add("padding", impl, "dense", None, causal, "dense", b * dense_pairs(n, causal),
                    dense)
                for frac in cfg.pad_fractions:
                    pads = pad_lengths(n, b, frac)
                    pairs = varlen_pairs([n - p for p in pads], causal)
                    prepare = (_prepare_key_mask_flashtile if impl in _FLASHTILE
                               else _prepare_key_mask_sdpa)(pads, causal)
                    add("padding", impl, "key_mask", float(frac), causal, "dense", pairs,
                        prepare, {"target": float(frac), "padded_keys": pads})
    return plan


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------

def variant_key(rec: dict[str, Any]) -> tuple:
    """What makes two records the same measurement (a new record replaces an old one with the
    same key in the results file): the target density / mean length stand for the measured
    ones."""
    detail = rec.get("detail") or {}
    param = detail.get("target", rec.get("param"))
    return (rec.get("device"), rec.get("sweep"), rec.get("impl"), rec.get("mode"),
            rec.get("variant"), param, rec.get("causal"), rec.get("dtype"), rec.get("d"),
            rec.get("n"), rec.get("batch"), rec.get("heads"))


def fill_ratios(records: list[dict]) -> list[dict]:
    """Set ``ratio_vs_dense`` of every ok record whose reference ran (in place)."""
    refs = {}
    for r in records:
        if r["variant"] == _REFERENCE.get(r["sweep"]) and r["status"] == "ok":
            refs[(r["sweep"], r["impl"], r["mode"], r["causal"], r["dtype"], r["d"], r["n"],
                  r["batch"], r["heads"], r["device"])] = r["ms"]
    for r in records:
        ref = refs.get((r["sweep"], r["impl"], r["mode"], r["causal"], r["dtype"], r["d"],
                        r["n"], r["batch"], r["heads"], r["device"]))
        r["ratio_vs_dense"] = r["ms"] / ref if r["status"] == "ok" and ref else None
    return records


def _record(env: dict, cfg: VariantsConfig, case: VariantCase, **fields) -> dict[str, Any]:
    return common.fill_record(RECORD_KEYS, env, dict(
        sweep=case.sweep, impl=case.impl, mode=case.mode, variant=case.variant, param=case.param,
        causal=case.causal, dtype=cfg.dtype, d=cfg.d, n=cfg.n, batch=cfg.batch, heads=cfg.heads,
        detail=case.detail, **fields))


def _make_data(kind: str, cfg: VariantsConfig, device: torch.device):
    if kind == "dense":
        return common.make_inputs(cfg.batch, cfg.n, cfg.heads, cfg.d, cfg.dtype, device, cfg.seed)
    lengths = varlen_lengths(cfg.total_tokens(), cfg.mean_length(), cfg.seed)
    return make_varlen_data(lengths, cfg.heads, cfg.d, cfg.dtype, device, cfg.seed)


# --------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------

def run_variants(cfg: VariantsConfig, timer: Callable[[Callable], float] | None = None,
                 stdout=None) -> list[dict]:
    """Run the plan of ``cfg``; merges the records into the results file after each case, then
    prints the table and draws the plots. Returns this run's records. Stops after a CUDA error
    that leaves the context unusable."""
    stdout = stdout or sys.stdout
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    if "flex" in cfg.impls and device.type == "cpu":
        common.log("flex: skipped on CPU (the FlexAttention peer is compiled for CUDA)")
    timer = timer or common.make_timer(device, cfg.warmup, cfg.rep)
    env = common.runtime_env(device)
    results = common.results_path(device, cfg.out)
    plan = build_plan(cfg)
    records: list[dict] = []
    progress = common.make_progress(len(plan), cfg.progress)
    data_kind, data, failure = None, None, None
    stop_reason = None
    reset_flex_cache()
    try:
        for case in plan:
            if case.data != data_kind:
                data = None
                gc.collect()
                common.empty_cache(device)
                data_kind, failure = case.data, None
                try:
                    data = _make_data(case.data, cfg, device)
                except Exception as exc:  # noqa: BLE001 - recorded for every case on it
                    if cfg.raise_errors:
                        raise
                    failure = (common.classify_error(exc, True),
                               f"making the inputs: {common.first_line(exc)}")
            progress.set_description(case.label())
            if failure is None:
                status, error, ms = common.time_call(
                    lambda c=case, x=data: c.prepare(x), case.mode, device, timer,
                    lambda c=case: _context(c.impl)(device), case.impl not in _FLASHTILE,
                    cfg.raise_errors)
            else:
                (status, error), ms = failure, None
            flop_count = _useful_flops(case.pairs, cfg.heads, cfg.d, case.mode)
            tflops = common.tflops_of(flop_count, ms) if status == "ok" else None
            records.append(_record(env, cfg, case, ms=ms, tflops=tflops, status=status,
                                   error=error))
            if status == "error":
                progress.write(f"error: {case.label()}: {error}")
            progress.update(1)
            common.merge_result(results, KEY, fill_ratios(records), variant_key)
            if common.is_fatal(error):
                stop_reason = f"unrecoverable CUDA error in {case.label()}"
                break
    finally:
        progress.close()
        data = None
        reset_flex_cache()
    if stop_reason is not None:
        common.log(f"{stop_reason}: ran {len(records)} of {len(plan)} cases")
    common.merge_result(results, KEY, fill_ratios(records), variant_key)
    print(render_table(records), file=stdout)
    written = [f"{results} [{KEY}]"]
    if cfg.plot:
        written += plot(records, cfg.plots)
    common.log("wrote " + ", ".join(str(p) for p in written))
    return records


# --------------------------------------------------------------------------------------------
# Table and plots
# --------------------------------------------------------------------------------------------

def _shape(r: dict) -> tuple:
    return (r["dtype"], r["d"], r["n"], r["batch"], r["heads"])


def _shape_text(shape: tuple) -> str:
    dtype, d, n, batch, heads = shape
    return f"{dtype}, d={d}, N={report.format_n(n)}, B={batch}, H={heads}"


def render_table(records: list[dict]) -> str:
    """One row per (sweep, variant, param, causal, mode), ``ms`` and ``ratio_vs_dense`` columns
    per impl; a failed cell shows "oom", "unsup" or "error". Split by device and shape."""
    recs = [r for r in records if "variant" in r]
    if not recs:
        return "(no variant records)"
    parts = []
    sweep_order = {s: i for i, s in enumerate(SWEEPS)}
    variant_order = {v: i for i, v in enumerate(("dense", "padded", "block_sparse", "window",
                                                 "varlen"))}
    for dev, dev_recs in report.by_device(recs):
        for shape in dict.fromkeys(_shape(r) for r in dev_recs):
            sel = [r for r in dev_recs if _shape(r) == shape]
            impls = report.ordered((r["impl"] for r in sel), IMPLS)
            cells = {}
            for r in sel:
                cells[(r["sweep"], r["variant"], variant_key(r)[5], bool(r["causal"]),
                       r["mode"], r["impl"])] = r
            keys = sorted({k[:-1] for k in cells}, key=lambda k: (
                sweep_order.get(k[0], 9), k[3], list(common.MODES).index(k[4])
                if k[4] in common.MODES else 9, variant_order.get(k[1], 9),
                -(k[2] or 0) if k[0] == "sparse" else (k[2] or 0)))
            header = ["sweep", "variant", "param", "causal", "mode"]
            header += [h for i in impls for h in (f"{i} ms", f"{i} /ref")]
            rows = []
            for key in keys:
                shown = next(cells[key + (i,)] for i in impls if key + (i,) in cells)
                row = [key[0], key[1], _fmt_param(key[1], shown["param"]), "1" if key[3] else "0",
                       key[4]]
                for impl in impls:
                    r = cells.get(key + (impl,))
                    if r is None:
                        row += ["-", "-"]
                    elif r["status"] != "ok":
                        row += [report.STATUS_CELL.get(r["status"], str(r["status"])), "-"]
                    else:
                        ratio = r.get("ratio_vs_dense")
                        row += [f"{r['ms']:.3g}", "-" if ratio is None else f"{ratio:.2f}"]
                rows.append(row)
            title = f"variants, {_shape_text(shape)} (ms; /ref = ms over the reference's ms)"
            parts.append((dev, title + "\n" + report.markdown(header, rows)))
    if len(parts) == 1:
        return parts[0][1]
    return "\n\n".join(f"device: {dev}\n{text}" for dev, text in parts)


def _line_plot(ax, sel: list[dict], variant: str, x_label: str, ref_label: str) -> None:
    from matplotlib.ticker import NullLocator

    xs_all = set()
    for impl in report.ordered((r["impl"] for r in sel), IMPLS):
        for mode in report.ordered((r["mode"] for r in sel), list(common.MODES)):
            pts = {r["param"]: r["ratio_vs_dense"] for r in sel
                   if r["impl"] == impl and r["mode"] == mode and r["variant"] == variant
                   and r["status"] == "ok" and r.get("ratio_vs_dense")}
            if pts:
                xs = sorted(pts)
                xs_all.update(xs)
                ax.plot(xs, [pts[x] for x in xs], marker="o", label=f"{impl} {mode}")
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    if variant == "block_sparse":
        ax.set_yscale("log", base=2)  # the proportional line is straight
    else:
        ax.set_ylim(bottom=0)
    if variant == "window" and xs_all:
        ax.set_xticks(sorted(xs_all))
        ax.set_xticklabels([report.format_n(int(x)) for x in sorted(xs_all)])
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(x_label)
    ax.set_ylabel(f"time / {ref_label} time")
    ax.grid(alpha=0.3, which="both")


def plot(records: list[dict], out_dir: Path | str) -> list[Path]:
    """``sparse.png`` (time / dense time against the measured density, with the proportional
    line), ``window.png`` (time / causal time against w), ``varlen.png`` (ms of packed and
    padded calls) and ``padding.png`` (time / unmasked time against the pad fraction), per
    device and shape (prefixed with them when there are several)."""
    recs = [r for r in records if "variant" in r]
    if not recs or not report.have_matplotlib():
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = [(dev, shape, [r for r in dev_recs if _shape(r) == shape])
              for dev, dev_recs in report.by_device(recs)
              for shape in dict.fromkeys(_shape(r) for r in dev_recs)]
    paths = []
    for dev, shape, sel in groups:
        prefix = "" if len(groups) == 1 else (
            f"{report.slug(dev)}_{shape[0]}_d{shape[1]}_n{shape[2]}_b{shape[3]}_h{shape[4]}_")
        for sweep in report.ordered((r["sweep"] for r in sel), SWEEPS):
            sweep_recs = [r for r in sel if r["sweep"] == sweep]
            if not any(r["status"] == "ok" for r in sweep_recs):
                continue
            fig, ax = report.figure()
            if sweep == "sparse":
                _line_plot(ax, sweep_recs, "block_sparse", "block density (measured)",
                           "dense")
                xs = sorted({r["param"] for r in sweep_recs if r["variant"] == "block_sparse"})
                if xs:
                    ax.plot(xs, xs, color="gray", linestyle="--", linewidth=1,
                            label="proportional to density")
                title = "block-sparse"
            elif sweep == "window":
                _line_plot(ax, sweep_recs, "window", "window w (window_size=(w, 0))", "causal")
                title = "sliding window, causal"
            elif sweep == "padding":
                _padding_plot(ax, sweep_recs)
                title = "padded batch (key mask) vs no mask"
            else:
                _varlen_bars(ax, sweep_recs)
                title = "varlen (packed) vs padded"
            if ax.lines or ax.patches:
                ax.legend(fontsize="small")
            ax.set_title(f"{title}: {_shape_text(shape)}\n{dev}", fontsize="medium")
            fig.tight_layout()
            path = out_dir / f"{prefix}{sweep}.png"
            fig.savefig(path, dpi=120)
            paths.append(path)
    return paths


def _padding_plot(ax, sel: list[dict]) -> None:
    """Time over the same implementation's unmasked call against the pad fraction, per
    implementation, mode and causal setting."""
    for impl in report.ordered((r["impl"] for r in sel), IMPLS):
        for mode in report.ordered((r["mode"] for r in sel), list(common.MODES)):
            for causal in (False, True):
                pts = {r["param"]: r["ratio_vs_dense"] for r in sel
                       if (r["impl"], r["mode"], r["causal"], r["variant"]) ==
                       (impl, mode, causal, "key_mask") and r["status"] == "ok"
                       and r.get("ratio_vs_dense")}
                if pts:
                    xs = sorted(pts)
                    ax.plot(xs, [pts[x] for x in xs], marker="o",
                            linestyle="-" if causal else "--",
                            label=f"{impl} {mode}{' causal' if causal else ''}")
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("pad fraction f (row r padded by f * N * (r + 1) / B keys)")
    ax.set_ylabel("time / unmasked time")
    ax.grid(alpha=0.3)


def _varlen_bars(ax, sel: list[dict]) -> None:
    groups = [(c, m) for c in (False, True)
              for m in report.ordered((r["mode"] for r in sel), list(common.MODES))]
    width = 0.27
    for j, variant in enumerate(("padded", "varlen", "varlen_paged")):
        heights = []
        for causal, mode in groups:
            ms = [r["ms"] for r in sel if r["variant"] == variant and bool(r["causal"]) == causal
                  and r["mode"] == mode and r["status"] == "ok"]
            heights.append(ms[0] if ms else 0.0)
        ax.bar([i + (j - 1) * width for i in range(len(groups))], heights, width,
               label=variant)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{'causal' if c else 'full'}\n{m}" for c, m in groups])
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3, axis="y")
    first = sel[0].get("detail") or {}
    if first:
        ax.set_xlabel(f"{first.get('sequences')} sequences, {first.get('tokens')} tokens, "
                      f"longest {first.get('longest')}")


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 1 when a flashtile case failed with an unexpected error, 2 for usage
    problems."""
    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        common.log("--device cuda but CUDA is not available")
        return 2
    start = time.monotonic()
    records = run_variants(cfg)
    common.log(f"{len(records)} cases in {time.monotonic() - start:.0f} s")
    return 1 if any(r["status"] == "error" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
