"""flash_attn_with_kvcache, merge_attention_states and build_tree_mask against a float64 reference.

Every behavioural test runs on both backends.  The Triton kernels run under the Triton
interpreter, which has to be switched on before triton-decorated modules are imported.  When the
session already interprets (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``) the
``triton``-parametrised tests run in this process.  Otherwise they are skipped here and
``test_triton_kernels_under_interpreter`` re-runs them (``-k triton``) in a child process with
``TRITON_INTERPRET=1``, started when this module's first test runs so that it works in parallel
with the torch-backend tests.
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import threading
import zlib

import pytest
import torch

import flashtile
from flashtile import paged_kv
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.kvcache import (build_tree_mask, flash_attn_with_kvcache, merge_attention_states,
                              select_decode_backend)

INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBPROCESS_TEST = "test_triton_kernels_under_interpreter"

BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        not INTERP, reason=f"runs in the TRITON_INTERPRET=1 child process ({SUBPROCESS_TEST})")),
]
TREE_PARENTS = [-1, 0, 1, 1, 2, 2, 3, 3, 4]
# the Triton 3.6 interpreter itself trips numpy's scalar-conversion deprecation
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
NAN = float("nan")


# --------------------------------------------------------------------------------------------
# interpreter child process
# --------------------------------------------------------------------------------------------
_CHILD: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _interpreter_child(request):
    wanted = not INTERP and any(item.name == SUBPROCESS_TEST for item in request.session.items)
    if wanted:
        log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        env.pop("FLASHTILE_BACKEND", None)
        cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-k", "triton",
               "-p", "no:cacheprovider", "-o", "addopts="]
        _CHILD["proc"] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _CHILD["log"] = log
    yield
    proc = _CHILD.pop("proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    log = _CHILD.pop("log", None)
    if log is not None:
        log.close()


@pytest.fixture
def backend(request, monkeypatch):
    name = request.param
    monkeypatch.setenv("FLASHTILE_BACKEND", name)
    return name


def _seed(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


# --------------------------------------------------------------------------------------------
# float64 (or same-dtype) reference
# --------------------------------------------------------------------------------------------
def _rope(x, cos, sin, pos, interleaved):
    """RoPE as complex multiplication; x (B, T, H, D) float, pos (B, T) int64."""
    rd = 2 * cos.shape[1]
    c = cos.to(x.dtype)[pos][:, :, None, :]
    s = sin.to(x.dtype)[pos][:, :, None, :]
    if interleaved:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
    else:
        a, b = x[..., : rd // 2], x[..., rd // 2: rd]
    re, im = a * c - b * s, a * s + b * c
    rot = torch.stack([re, im], -1).flatten(-2) if interleaved else torch.cat([re, im], -1)
    return torch.cat([rot, x[..., rd:]], -1)


def _reference(inp, dtype=torch.float64):
    """Naive attention over the cache after the append.  Returns (out, lse, k_logical, v_logical)
    with out/lse in ``dtype`` and the caches in their own dtype (what the cache must contain)."""
    c = inp.case
    q = inp.q
    b, sq, h, d = q.shape
    hk = inp.k_logical.shape[2]
    kc, vc = inp.k_logical.clone(), inp.v_logical.clone()
    lens, pads, rows = inp.lens, inp.pads, inp.rows
    per_token = c.causal or c.window != (-1, -1) or c.tree is not None
    if inp.k_new is not None:
        kn = inp.k_new.double()
        if inp.cos is not None:
            pos = torch.tensor(lens)[:, None] + torch.arange(c.s_new)
            kn = _rope(kn, inp.cos.double(), inp.sin.double(), pos, c.rotary == "interleaved")
        for i in range(b):
            kc[rows[i], lens[i]:lens[i] + c.s_new] = kn[i].to(kc.dtype)
            vc[rows[i], lens[i]:lens[i] + c.s_new] = inp.v_new[i]
    qd = q.double()
    if inp.cos is not None:
        offs = torch.arange(sq) if per_token else torch.zeros(sq, dtype=torch.int64)
        qd = _rope(qd, inp.cos.double(), inp.sin.double(), torch.tensor(lens)[:, None] + offs,
                   c.rotary == "interleaved")
        if dtype != torch.float64:
            qd = qd.to(q.dtype)
    out = torch.zeros(b, sq, h, d, dtype=dtype)
    lse = torch.full((b, h, sq), -math.inf, dtype=dtype)
    heads = torch.arange(h) // (h // hk)
    scale = c.scale if c.scale is not None else d ** -0.5
    wl, wr = c.window
    if c.causal:
        wr = 0
    for i in range(b):
        n = lens[i] + c.s_new - pads[i]
        keys = kc[rows[i], pads[i]:pads[i] + n].to(dtype)[:, heads]  # (n, H, D)
        vals = vc[rows[i], pads[i]:pads[i] + n].to(dtype)[:, heads]
        s = torch.einsum("shd,nhd->hsn", qd[i].to(dtype), keys) * scale
        if c.softcap > 0:
            s = c.softcap * torch.tanh(s / c.softcap)
        t = torch.arange(sq)[:, None]
        j = torch.arange(n)[None, :]
        shift = n - sq
        if inp.alibi is not None:
            slopes = inp.alibi if inp.alibi.dim() == 1 else inp.alibi[i]
            s = s - slopes.to(dtype)[:, None, None] * (t + shift - j).abs().to(dtype)
        vis = torch.ones(sq, n, dtype=torch.bool)
        if wl >= 0:
            vis &= j >= t + shift - wl
        if wr >= 0:
            vis &= j <= t + shift + wr
        if inp.tree_bool is not None:
            tb = inp.tree_bool[i if inp.tree_bool.shape[0] > 1 else 0]
            for tt in range(sq):
                for jj in range(max(n - sq, 0), n):
                    vis[tt, jj] &= bool(tb[tt, jj - (n - sq)])
        s = s.masked_fill(~vis, -math.inf)
        seen = vis.any(-1)  # (Sq,)
        p = torch.softmax(s, -1)
        p = torch.where(seen[None, :, None], p, torch.zeros((), dtype=dtype))
        out[i] = torch.einsum("hsn,nhd->shd", p, vals)
        lse[i] = torch.where(seen[None, :], torch.logsumexp(s, -1), torch.full((), -math.inf, dtype=dtype))
    return out, lse, kc, vc


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    b: int = 2
    sq: int = 1
    h: int = 4
    hk: int = 2
    d: int = 32
    cap: int = 64
    s_new: int = 0
    dtype: torch.dtype = torch.float32
    page: int = 0  # 0: contiguous cache
    lens: tuple | None = None
    pads: tuple | None = None
    batch_idx: tuple | None = None  # cache rows of the batch rows (cache has max+1 rows)
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: str | None = None  # "h" or "bh"
    rotary: str | None = None  # "interleaved" or "neox"
    rotary_dim: int | None = None
    tree: str | None = None  # "bool", "packed", "batch"
    scale: float | None = None
    splits: int = 0
    lens_int: bool = False


@dataclasses.dataclass
class Inputs:
    case: Case
    q: torch.Tensor
    k_logical: torch.Tensor  # (rows, cap, Hk, D) what the cache holds, NaN outside valid keys
    v_logical: torch.Tensor
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    alibi: torch.Tensor | None
    tree_bool: torch.Tensor | None
    tree_arg: torch.Tensor | None
    lens: list
    pads: list
    rows: list
    k_cache: torch.Tensor  # what the call receives (physical)
    v_cache: torch.Tensor
    block_table: torch.Tensor | None
    spare_pages: torch.Tensor | None


def _rotary_tables(n_pos, rotary_dim, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _make(c: Case, gen: torch.Generator) -> Inputs:
    dt = c.dtype
    n_rows = (max(c.batch_idx) + 1) if c.batch_idx is not None else c.b
    rows = list(c.batch_idx) if c.batch_idx is not None else list(range(c.b))
    if c.lens is not None:
        lens = list(c.lens)
    else:
        lens = torch.randint(0, c.cap - c.s_new + 1, (c.b,), generator=gen).tolist()
    pads = list(c.pads) if c.pads is not None else [0] * c.b

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dt)

    q = rnd(c.b, c.sq, c.h, c.d)
    k_log = rnd(n_rows, c.cap, c.hk, c.d)
    v_log = rnd(n_rows, c.cap, c.hk, c.d)
    # poison every slot that must not be read: before leftpad, from cache_seqlens on (the
    # append overwrites its slots first), and rows no batch row maps to
    valid = torch.zeros(n_rows, c.cap, dtype=torch.bool)
    for i in range(c.b):
        valid[rows[i], pads[i]:lens[i]] = True
    k_log[~valid] = NAN
    v_log[~valid] = NAN
    k_new = rnd(c.b, c.s_new, c.hk, c.d) if c.s_new else None
    v_new = rnd(c.b, c.s_new, c.hk, c.d) if c.s_new else None
    cos = sin = None
    if c.rotary is not None:
        cos, sin = _rotary_tables(c.cap + c.sq + 4, c.rotary_dim or c.d)
    alibi = None
    if c.alibi == "h":
        alibi = torch.rand(c.h, generator=gen) * 0.5 + 0.05
    elif c.alibi == "bh":
        alibi = torch.rand(c.b, c.h, generator=gen) * 0.5 + 0.05
    tree_bool = tree_arg = None
    if c.tree is not None:
        if c.tree == "batch":
            parents = torch.tensor([TREE_PARENTS[: c.sq], [-1] + list(range(c.sq - 1))])  # a branching tree, a chain
            tree_bool = build_tree_mask(parents)
            tree_arg = tree_bool
        else:
            tree_bool = build_tree_mask(TREE_PARENTS[: c.sq]).unsqueeze(0)
            tree_arg = tree_bool if c.tree == "bool" else build_tree_mask(TREE_PARENTS[: c.sq], packed=True).unsqueeze(0)
    block_table = spare = None
    if c.page:
        per = c.cap // c.page
        nb = c.b * per + 3
        perm = torch.randperm(nb, generator=gen)
        used = perm[: c.b * per]
        k_cache = torch.full((nb, c.page, c.hk, c.d), NAN, dtype=dt)
        v_cache = torch.full((nb, c.page, c.hk, c.d), NAN, dtype=dt)
        k_cache[used] = k_log.reshape(c.b * per, c.page, c.hk, c.d)
        v_cache[used] = v_log.reshape(c.b * per, c.page, c.hk, c.d)
        block_table = used.reshape(c.b, per).to(torch.int32)
        spare = perm[c.b * per:]
    else:
        k_cache, v_cache = k_log.clone(), v_log.clone()
    return Inputs(c, q, k_log, v_log, k_new, v_new, cos, sin, alibi, tree_bool, tree_arg, lens, pads,
                  rows, k_cache, v_cache, block_table, spare)


def _call(inp: Inputs, **overrides):
    c = inp.case
    kwargs = dict(
        k=inp.k_new, v=inp.v_new, rotary_cos=inp.cos, rotary_sin=inp.sin,
        cache_seqlens=(inp.lens[0] if c.lens_int else torch.tensor(inp.lens, dtype=torch.int32)),
        cache_batch_idx=torch.tensor(inp.rows, dtype=torch.int32) if c.batch_idx is not None else None,
        cache_leftpad=torch.tensor(inp.pads, dtype=torch.int32) if c.pads is not None else None,
        block_table=inp.block_table, softmax_scale=c.scale, causal=c.causal, window_size=c.window,
        softcap=c.softcap, rotary_interleaved=(c.rotary != "neox"), alibi_slopes=inp.alibi,
        num_splits=c.splits, return_softmax_lse=True, tree_mask=inp.tree_arg,
    )
    kwargs.update(overrides)
    return flash_attn_with_kvcache(inp.q, inp.k_cache, inp.v_cache, **kwargs)


def _logical(inp: Inputs, cache: torch.Tensor) -> torch.Tensor:
    if inp.block_table is None:
        return cache
    return cache[inp.block_table.long()].reshape(inp.case.b, -1, *cache.shape[2:])


def _check(inp: Inputs, out, lse):
    c = inp.case
    ref, ref_lse, k_exp, v_exp = _reference(inp)
    assert out.dtype == c.dtype and out.shape == (c.b, c.sq, c.h, c.d)
    assert lse.dtype == torch.float32 and lse.shape == (c.b, c.h, c.sq)
    assert not out.isnan().any()
    if c.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        ref_lp = _reference(inp, dtype=c.dtype)[0]
        err = (out.double() - ref).abs().max().item()
        err_math = (ref_lp.double() - ref).abs().max().item()
        assert err <= 2 * err_math + 1e-5, f"error {err:.3g} vs same-dtype torch math {err_math:.3g}"
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5 if c.dtype == torch.float32 else 1e-3,
                               atol=1e-5 if c.dtype == torch.float32 else 1e-3)
    # cache contents: appended (rotated) tokens written, everything else untouched
    rtol = 0.0 if c.rotary is None else (1e-5 if c.dtype == torch.float32 else 1e-3)
    for got, exp in ((_logical(inp, inp.k_cache), k_exp), (_logical(inp, inp.v_cache), v_exp)):
        if inp.block_table is None:
            torch.testing.assert_close(got, exp, rtol=rtol, atol=1e-6 if rtol else 0.0, equal_nan=True)
        else:
            rows = torch.tensor(inp.rows)
            torch.testing.assert_close(got, exp[rows], rtol=rtol, atol=1e-6 if rtol else 0.0, equal_nan=True)
    if inp.spare_pages is not None:
        assert inp.k_cache[inp.spare_pages].isnan().all() and inp.v_cache[inp.spare_pages].isnan().all()


CASES = {
    "mha-contig-fp32": Case(h=4, hk=4, lens=(17, 50)),
    "gqa-append-fp32-len0": Case(sq=2, s_new=2, lens=(0, 37)),
    "mqa-append-fp16": Case(hk=1, s_new=1, dtype=torch.float16, lens=(9, 63)),
    "gqa-paged16-append-fp32": Case(page=16, sq=3, s_new=3, lens=(5, 40), causal=True),
    "gqa-paged32-fp16": Case(page=32, cap=96, s_new=1, dtype=torch.float16, lens=(70, 31)),
    "paged48-mqa": Case(page=48, cap=96, hk=1, s_new=2, sq=2, lens=(47, 60)),
    "causal-sq4": Case(sq=4, s_new=4, causal=True, lens=(3, 40)),
    "window-left": Case(sq=3, s_new=3, window=(8, 0), lens=(20, 50)),
    "window-both": Case(sq=3, window=(5, 2), lens=(30, 12)),
    "softcap": Case(sq=2, s_new=1, softcap=1.5, scale=0.5, lens=(30, 44)),
    "alibi-h": Case(sq=2, s_new=2, causal=True, alibi="h", lens=(25, 7)),
    "alibi-bh-softcap": Case(alibi="bh", softcap=3.0, lens=(40, 18)),
    "leftpad": Case(sq=2, s_new=2, pads=(3, 10), lens=(20, 45), causal=True),
    "leftpad-paged": Case(page=16, s_new=1, pads=(17, 0), lens=(33, 5)),
    "batch-idx": Case(batch_idx=(3, 1), s_new=2, sq=2, lens=(12, 40)),
    "empty-rows": Case(lens=(0, 0)),
    "queries-before-keys": Case(sq=4, causal=True, lens=(2, 0)),
    "headdim-40": Case(d=40, hk=1, s_new=1, lens=(21, 33)),
    "int-seqlens": Case(s_new=2, lens=(30, 30), lens_int=True, causal=True),
    "rotary-interleaved-causal": Case(sq=2, s_new=2, rotary="interleaved", causal=True, lens=(10, 40)),
    "rotary-neox-noncausal": Case(sq=2, s_new=2, rotary="neox", lens=(3, 27)),
    "rotary-partial-paged-fp16": Case(page=16, sq=1, s_new=1, rotary="neox", rotary_dim=16,
                                      dtype=torch.float16, lens=(44, 0)),
    "rotary-interleaved-partial-batchidx": Case(batch_idx=(0, 2), s_new=3, sq=3, rotary="interleaved",
                                                rotary_dim=8, window=(6, 0), lens=(16, 29)),
    "many-splits": Case(cap=160, s_new=1, lens=(150, 77), splits=5),
    "everything": Case(page=16, cap=96, sq=3, s_new=3, h=6, hk=2, pads=(4, 20), lens=(40, 71),
                       rotary="interleaved", causal=True, softcap=4.0, alibi="bh", splits=3),
    "gqa-append-bf16": Case(sq=2, s_new=2, dtype=torch.bfloat16, causal=True, softcap=4.0, lens=(30, 50)),
    "everything-fp16": Case(page=32, cap=96, sq=2, s_new=2, h=4, hk=1, pads=(0, 9), lens=(61, 30),
                            rotary="neox", window=(12, 0), softcap=5.0, alibi="h", splits=2,
                            dtype=torch.float16),
}


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("name", list(CASES))
def test_kvcache_matches_reference(backend, name):
    if backend == "triton" and CASES[name].dtype == torch.bfloat16:
        pytest.skip("the Triton 3.6 interpreter mis-reads bfloat16 (compiled kernels are fine)")
    inp = _make(CASES[name], _seed(name))
    out, lse = _call(inp)
    _check(inp, out, lse)


@pytest.mark.skipif(not INTERP, reason=f"runs in the TRITON_INTERPRET=1 child process ({SUBPROCESS_TEST})")
@pytest.mark.parametrize("tile", [16, 32], ids=["tile-in-one-page", "tile-over-two-pages"])
def test_paged_page_lookup_per_tile_and_per_key(monkeypatch, tile):
    """A key tile inside one page looks its page up once, a tile over several pages per key
    (16-slot pages, 16- or 32-key tiles); both against the float64 reference, with leftpad so
    that a tile starts before the row's first key."""
    from flashtile.backends.triton import launch_decode

    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    cfg = launch_decode._attn_config
    monkeypatch.setattr(launch_decode, "_attn_config",
                        lambda *a: (cfg(*a)[0], tile) + tuple(cfg(*a)[2:]))
    launch_decode._plan.cache_clear()
    try:
        c = Case(page=16, cap=96, sq=2, s_new=1, lens=(70, 9), pads=(5, 0), causal=True)
        inp = _make(c, _seed("page-lookup", tile))
        with poison_outputs():
            out, lse = _call(inp, num_splits=3)
        _check(inp, out, lse)
    finally:
        launch_decode._plan.cache_clear()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["contig", "paged16"])
def test_num_splits_do_not_change_result(backend, layout):
    c = Case(cap=128, page=16 if layout == "paged16" else 0, sq=2, s_new=2, h=4, hk=2,
             lens=(121, 45), causal=True)
    results = []
    for splits in (1, 2, 3, 8, 16):  # 16: more splits than the interpreter's 8 key tiles
        inp = _make(c, _seed("splits", layout))
        with poison_outputs():  # outputs and partials start as NaN: every element is written
            out, lse = _call(inp, num_splits=splits)
        _check(inp, out, lse)
        results.append((out, lse))
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("form", ["bool", "packed", "batch"])
def test_tree_mask_speculative_verification(backend, form):
    # the 9 drafted tokens of a branching tree are appended and verified in one call
    c = Case(sq=9, s_new=9, cap=64, h=4, hk=2, lens=(10, 41), tree=form)
    inp = _make(c, _seed("tree", form))
    out, lse = _call(inp)
    _check(inp, out, lse)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_tree_mask_with_rotary_and_previously_appended_tokens(backend):
    # first call appends the tree tokens with rotary; second attends with k=None: the tree
    # tokens are then the last seqlen_q keys already in the cache
    c = Case(sq=5, s_new=5, cap=48, lens=(6, 30), tree="bool", rotary="interleaved", page=16)
    inp = _make(c, _seed("tree-rotary"))
    out, lse = _call(inp)
    _check(inp, out, lse)
    lens_after = torch.tensor(inp.lens, dtype=torch.int32) + c.s_new
    cos, sin = inp.cos, inp.sin
    q2 = _rope(inp.q.double(), cos.double(), sin.double(),
               torch.tensor(inp.lens)[:, None] + torch.arange(c.sq), True).to(c.dtype)
    out2, lse2 = flash_attn_with_kvcache(q2, inp.k_cache, inp.v_cache, cache_seqlens=lens_after,
                                         block_table=inp.block_table, tree_mask=inp.tree_arg,
                                         return_softmax_lse=True)
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse2, lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_strided_index_tensors(backend):
    # index tensors that are views with non-unit strides must be read correctly
    c = Case(page=16, s_new=1, sq=1, lens=(20, 41), pads=(2, 5), alibi="bh")
    inp = _make(c, _seed("strided"))
    lens = torch.tensor([[inp.lens[0], -7], [inp.lens[1], -7]], dtype=torch.int32)[:, 0]
    pads = torch.tensor([[inp.pads[0], 99], [inp.pads[1], 99]], dtype=torch.int32)[:, 0]
    table = inp.block_table.t().contiguous().t()  # column-major
    alibi = torch.stack([inp.alibi, inp.alibi * 0 + 99.0], dim=1)[:, 0]  # row stride 2 * nheads
    assert not (lens.is_contiguous() or pads.is_contiguous() or table.is_contiguous())
    inp.block_table = table
    out, lse = _call(inp, cache_seqlens=lens, cache_leftpad=pads, alibi_slopes=alibi)
    _check(inp, out, lse)


def test_build_tree_mask_example():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    mask = build_tree_mask(TREE_PARENTS)
    assert mask.dtype == torch.bool and torch.equal(mask, expected)
    packed = build_tree_mask(TREE_PARENTS, packed=True)
    assert packed.dtype == torch.int64
    assert packed.tolist() == [sum(1 << j for j in range(9) if expected[i, j]) for i in range(9)]
    batched = build_tree_mask(torch.tensor([TREE_PARENTS, [-1, 0, 1, 2, 3, 4, 5, 6, 7]]))
    assert torch.equal(batched[0], expected) and torch.equal(batched[1], torch.ones(9, 9).tril().bool())


def test_build_tree_mask_64_nodes_packed_sign_bit():
    parents = [-1] + list(range(63))  # a chain: lower-triangular mask, bit 63 set on the last row
    packed = build_tree_mask(parents, packed=True)
    unpacked = ((packed[:, None] >> torch.arange(64)) & 1).bool()
    assert torch.equal(unpacked, torch.ones(64, 64).tril().bool())


@pytest.mark.parametrize("parents,err", [
    pytest.param([-1, 1], ValueError, id="self-parent"),
    pytest.param([-1, 2, 0], ValueError, id="forward-parent"),
    pytest.param([-1, -2], ValueError, id="bad-root"),
    pytest.param([[[-1]]], ValueError, id="3d"),
    pytest.param([-1.0, 0.0], TypeError, id="float"),
])
def test_build_tree_mask_rejects(parents, err):
    with pytest.raises(err, match="parents"):
        build_tree_mask(parents)
    with pytest.raises(ValueError, match="64"):
        build_tree_mask([-1] + list(range(64)), packed=True)


# --------------------------------------------------------------------------------------------
# merge_attention_states
# --------------------------------------------------------------------------------------------
def _merge_ref(oa, la, ob, lb):
    la, lb = la.double(), lb.double()
    lse = torch.logaddexp(la, lb)
    wa = torch.exp(la - lse).nan_to_num(0.0).transpose(1, 2)[..., None]
    wb = torch.exp(lb - lse).nan_to_num(0.0).transpose(1, 2)[..., None]
    out = torch.where(wa > 0, oa.double() * wa, 0.0) + torch.where(wb > 0, ob.double() * wb, 0.0)
    return out, lse


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_merge_attention_states(backend, dtype):
    gen = _seed("merge", str(dtype))
    b, s, h, d = 2, 3, 4, 40
    oa = torch.randn(b, s, h, d, generator=gen).to(dtype)
    ob = torch.randn(b, s, h, d, generator=gen).to(dtype)
    la = torch.randn(b, h, s, generator=gen) * 3
    lb = torch.randn(b, h, s, generator=gen) * 3
    # empty sides: a only at (0, 0, 0), b only at (0, 1, 1), both at (1, 2, 2); garbage outputs there
    la[0, 0, 0] = -math.inf
    oa[0, 0, 0] = NAN
    lb[0, 1, 1] = -math.inf
    ob[0, 1, 1] = NAN
    la[1, 2, 2] = lb[1, 2, 2] = -math.inf
    oa[1, 2, 2] = ob[1, 2, 2] = NAN
    out, lse = merge_attention_states(oa, la, ob, lb)
    ref, ref_lse = _merge_ref(oa, la, ob, lb)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[0, 0, 0], ob[0, 0, 0]) and torch.equal(out[0, 1, 1], oa[0, 1, 1])
    assert (out[1, 2, 2] == 0).all() and lse[1, 2, 2] == -math.inf


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_merge_of_two_cache_halves_equals_whole(backend):
    # attention over keys [0, 40) merged with attention over [40, 70) == attention over [0, 70)
    c = Case(b=2, sq=2, cap=80, lens=(70, 70))
    inp = _make(c, _seed("halves"))
    full, full_lse = _call(inp)
    first, first_lse = _call(inp, cache_seqlens=torch.tensor([40, 40], dtype=torch.int32))
    # second half: the same cache viewed from position 40 on (leftpad hides the first half)
    second, second_lse = _call(inp, cache_leftpad=torch.tensor([40, 40], dtype=torch.int32))
    out, lse = merge_attention_states(first, first_lse, second, second_lse)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-5)


def test_merge_attention_states_rejects_mismatches():
    o = torch.randn(1, 2, 3, 8)
    lse = torch.randn(1, 3, 2)
    with pytest.raises(ValueError, match="lse_b"):
        merge_attention_states(o, lse, o, lse.transpose(1, 2))
    with pytest.raises(ValueError, match="out_b"):
        merge_attention_states(o, lse, o[:, :1], lse)
    with pytest.raises(TypeError, match="out_b"):
        merge_attention_states(o, lse, o.half(), lse)
    with pytest.raises(TypeError, match="lse_a"):
        merge_attention_states(o, None, o, lse)


# --------------------------------------------------------------------------------------------
# misc behaviour
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_default_cache_seqlens_is_whole_cache_and_no_grad(backend):
    gen = _seed("default")
    q = torch.randn(2, 1, 4, 16, generator=gen).requires_grad_()
    kc = torch.randn(2, 24, 2, 16, generator=gen)
    vc = torch.randn(2, 24, 2, 16, generator=gen)
    out = flash_attn_with_kvcache(q, kc, vc)
    assert not out.requires_grad
    g = 2
    s = torch.einsum("bqhd,bkhd->bhqk", q.detach().double(), kc.double().repeat_interleave(g, 2)) * 16 ** -0.5
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vc.double().repeat_interleave(g, 2))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_num_splits_heuristic():
    from flashtile.backends.triton.launch_decode import choose_num_splits

    assert choose_num_splits(8, 1, 4096) == 1  # CPU
    assert choose_num_splits(256, 132, 4096) == 1  # batch 32: the grid already fills an H100
    assert choose_num_splits(512, 132, 256) == 4  # batch 64: waves of whole rows are evened out
    assert choose_num_splits(4096, 132, 4096) == 1  # batch 512: already many programs per SM
    assert choose_num_splits(8, 132, 2048) == 16  # batch 1, 8 KV heads, 128K keys: one wave
    assert choose_num_splits(64, 132, 256) == 2  # batch 8, 16K keys
    assert choose_num_splits(64, 132, 256, paged=True) == 4  # paged: two programs per SM
    assert choose_num_splits(8, 132, 256, paged=True) == 33
    assert choose_num_splits(512, 132, 256, paged=True) == 4
    # pages smaller than a tile at batch 64: the per-key lookups of extra splits cost more
    assert choose_num_splits(512, 132, 256, paged=True, per_key_pages=True) == 1
    assert choose_num_splits(8, 132, 256, paged=True, per_key_pages=True) == 33  # batch 1 still splits
    assert choose_num_splits(8, 132, 8) <= 2  # a short cache is not worth splitting
    # three programs an SM (396 slots): batch 48 / 96 at 8 KV heads fill 0.97 / 1.94 waves
    # unsplit; batch 64's 1.29 waves are split; unknown slots or a paged cache: the 16-an-SM rule
    assert choose_num_splits(384, 132, 64, resident=3) == 1
    assert choose_num_splits(768, 132, 64, resident=3) == 1
    assert choose_num_splits(512, 132, 64, resident=3) == 4
    assert choose_num_splits(384, 132, 64) == 5
    assert choose_num_splits(384, 132, 64, paged=True, resident=3) == 5
    for n_prog in (1, 3, 8, 24, 64, 100):
        for tiles in (1, 16, 64, 2048):
            assert 1 <= choose_num_splits(n_prog, 132, tiles) <= 128


_TILE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", _TILE_DTYPES, ids=["fp16", "bf16", "fp32"])
def test_gpu_tile_shapes_fit_shared_memory_and_pages(dtype):
    """The compiled kernels' tiles (computed, not launched): powers of two that with three
    stages and the query tile fit SMEM_BUDGET; a program alone on its SM gets at least the
    tile of one sharing it; a tile never straddles a page of 64 slots or more."""
    from flashtile.backends.triton import launch_decode as ld

    elt = dtype.itemsize
    for d in (32, 64, 96, 128, 256):
        for rows in (1, 4, 64):
            for page in (0, 16, 32, 48, 64, 128, 256, 1024):
                tiles = {}
                for alone in (True, False):
                    bm, bn, bd, warps, stages = ld._attn_config(True, d, rows, dtype, page, alone)
                    case = f"d={d} rows={rows} page={page} alone={alone}: tile {bn}"
                    assert bn >= 16 and bn & (bn - 1) == 0, case
                    assert stages * 2 * bn * bd * elt + bm * bd * elt <= ld.SMEM_BUDGET, case
                    if page and page & -page >= 64:
                        assert page % bn == 0, case
                    tiles[alone] = bn
                assert tiles[True] >= tiles[False], f"d={d} rows={rows} page={page}"


@pytest.mark.parametrize("tile,want", [((16, 64, 128), 71680), ((16, 128, 64), 71680),
                                       ((16, 32, 256), 74752), ((16, 256, 64), 141312),
                                       ((16, 128, 128), 139264), ((16, 64, 256), 141312)],
                         ids=["d128", "d64", "d256", "d64-alone", "d128-alone", "d256-alone"])
def test_resident_programs_count_the_compiled_kernels_shared_memory(tile, want):
    """``resident_programs`` by the shared memory the compiled bf16 kernels of three stages
    take (``metadata.shared`` on the H200, ``want``) plus the 1 KB a block reserves: three an
    SM of 228 KB for the 32 KB stages, one for the 64 KB ones, none where the SM is unknown."""
    from flashtile.backends.triton.launch_decode import resident_programs

    sm = 233472
    assert resident_programs(*tile, 3, 2, sm) == sm // (want + 1024)
    assert resident_programs(*tile, 3, 2, sm) == (3 if want < 75000 else 1)
    assert resident_programs(*tile, 3, 2, 0) == 0


def test_programs_alone_on_their_sms_get_the_larger_tiles():
    """``_plan`` (batch, 8 KV heads, one query, d = 128 bf16, 132 SMs): up to 132 programs
    before splitting (batch <= 16) each stream 128-key tiles, more stream 64-key ones; the
    split count keeps at least MIN_KEYS_PER_SPLIT keys a split."""
    from flashtile.backends.triton import launch_decode as ld

    def plan(batch, cap, splits=0, page=0):
        bm, bn, _, _, _, m_blocks, s = ld._plan(True, 128, 1, 4, torch.bfloat16, batch, 8, cap,
                                                132, splits, page)
        return bn, s

    assert plan(1, 4096) == (128, 16)  # 8 programs x 16 splits of 256 keys
    assert plan(1, 16384) == (128, 16)
    assert plan(8, 16384) == (128, 2)
    assert plan(16, 65536) == (128, 1)  # 128 programs: one wave without splitting
    assert plan(32, 4096) == (64, 1)  # 256 programs: two an SM
    assert plan(64, 16384) == (64, 4)
    assert plan(8, 16384, splits=5) == (128, 5)  # the tile follows the programs, not the split
    assert plan(8, 16384, page=256) == (128, 4)  # paged: two programs an SM hide the lookups
    assert plan(8, 16384, page=64) == (64, 4)  # a tile inside one page
    assert plan(1, 512) == (128, 2)
    assert plan(1, 200)[1] == 1
    # with the SM's shared memory known (228 KB: three programs of 64-key tiles an SM), batch
    # 48 fills 0.97 of a wave unsplit; batch 64 is split as before
    assert ld._plan(True, 128, 1, 4, torch.bfloat16, 48, 8, 4096, 132, 0, 0, 233472)[-1] == 1
    assert ld._plan(True, 128, 1, 4, torch.bfloat16, 48, 8, 4096, 132, 0, 0)[-1] == 5
    assert ld._plan(True, 128, 1, 4, torch.bfloat16, 64, 8, 4096, 132, 0, 0, 233472)[-1] == 4


def test_narrow_heads_share_sms_from_two_batch_rows():
    """d = 64 in 16-bit types (``_plan``, 8 KV heads, 132 SMs): batch 1 keeps the 256-key
    tiles of programs alone on their SMs; batch 2-16 take 128-key tiles and about two
    programs an SM after splitting; fp32, paged caches and d = 128 keep their rules."""
    from flashtile.backends.triton import launch_decode as ld

    def plan(batch, cap, d=64, dtype=torch.bfloat16, page=0):
        bm, bn, _, _, _, _, s = ld._plan(True, d, 1, 4, dtype, batch, 8, cap, 132, 0, page)
        return bn, s

    assert plan(1, 4096) == (256, 16)
    assert plan(2, 16384) == (128, 16)
    assert plan(4, 16384) == (128, 8)
    assert plan(8, 16384) == (128, 4)
    assert plan(16, 4096, dtype=torch.float16) == (128, 2)
    assert plan(32, 4096) == (128, 1)
    assert plan(4, 16384, dtype=torch.float32) == (128, 4)  # alone: 64 KB stages of fp32
    assert plan(8, 16384, page=256) == (256, 4)
    assert plan(4, 16384, d=128) == (128, 4)


# --------------------------------------------------------------------------------------------
# host side of the triton path (no kernel runs: launches are recorded, not executed)
# --------------------------------------------------------------------------------------------
def _record_launches(monkeypatch):
    """Replace the innermost ``run`` of each decode kernel (below ``triton.heuristics``) with a
    recorder; returns the list of launched kernel names."""
    from flashtile.backends.triton import launch_decode

    launches = []
    for name in ("_check_kernel", "_split_kv_kernel", "_combine_kernel", "_rotary_append_kernel"):
        inner = getattr(launch_decode, name)
        while hasattr(inner, "fn") and hasattr(inner.fn, "run"):
            inner = inner.fn
        monkeypatch.setattr(inner, "run", lambda *a, _name=name, **kw: launches.append(_name))
    return launches


@pytest.mark.skipif(not INTERP, reason=f"runs in the TRITON_INTERPRET=1 child process ({SUBPROCESS_TEST})")
@pytest.mark.parametrize("mode", ["async", "sync", "off"])
@pytest.mark.parametrize("case,expected", [
    ("attend", ["_split_kv_kernel"]),
    ("attend-splits", ["_split_kv_kernel", "_combine_kernel"]),
    ("append", ["_rotary_append_kernel", "_split_kv_kernel"]),
    ("append-rotary", ["_rotary_append_kernel", "_rotary_append_kernel", "_split_kv_kernel"]),
    ("append-over-budget", ["_check_kernel", "_rotary_append_kernel", "_split_kv_kernel"]),
])
def test_triton_launches_only_what_the_call_uses(monkeypatch, case, expected, mode):
    """The index check costs no launch of its own (it runs inside the append, or the split-KV
    kernel when nothing is appended), except before an append too large to carry it."""
    from flashtile.backends.triton import launch_decode

    launches = _record_launches(monkeypatch)
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", mode)
    if case == "append-over-budget":
        monkeypatch.setattr(launch_decode, "FUSED_CHECK_BUDGET", 0)
        if mode == "off":
            expected = expected[1:]
    monkeypatch.setattr(launch_decode._Ring, "_wait", lambda self, slot: True)  # nothing ran
    gen = _seed("launches-" + case)
    b, cap, h, hk, d = 2, 48, 4, 2, 16
    q = torch.randn(b, 1, h, d, generator=gen).requires_grad_()
    kc, vc = torch.randn(b, cap, hk, d, generator=gen), torch.randn(b, cap, hk, d, generator=gen)
    kw = dict(cache_seqlens=torch.tensor([30, 7], dtype=torch.int32), return_softmax_lse=True)
    if case == "attend-splits":
        kw["num_splits"] = 3
    if case.startswith("append"):
        kw["k"], kw["v"] = torch.randn(b, 1, hk, d, generator=gen), torch.randn(b, 1, hk, d, generator=gen)
    if case == "append-rotary":
        kw["rotary_cos"], kw["rotary_sin"] = torch.ones(cap, 4), torch.zeros(cap, 4)
    out, lse = flash_attn_with_kvcache(q, kc, vc, **kw)
    assert launches == expected
    assert out.shape == q.shape and lse.shape == (b, h, 1)
    assert not out.requires_grad and not lse.requires_grad


def _params(kernel):
    """``(runtime argument names, constexpr names)`` of a jitted kernel, in signature order."""
    import inspect

    params = inspect.signature(kernel.fn.fn).parameters.values()
    const = [p.name for p in params if "constexpr" in str(p.annotation)]
    return [n for n in kernel.arg_names if n not in const], const


@pytest.mark.parametrize("kernel_name", ["_split_kv_kernel", "_rotary_append_kernel", "_check_kernel"])
def test_triton_launch_helper_derives_the_same_constexprs_as_triton(monkeypatch, kernel_name):
    """``launch_decode._go`` launches by keyword and evaluates a kernel's ``triton.heuristics``
    itself; the jitted function must receive exactly what Triton's own wrapper would pass it."""
    from triton.runtime.autotuner import Heuristics

    from flashtile.backends.triton import launch_decode

    kernel = getattr(launch_decode, kernel_name)
    assert isinstance(kernel, Heuristics)
    seen = []
    monkeypatch.setattr(kernel.fn, "run", lambda *a, **kw: seen.append((a, kw)))
    runtime, const = _params(kernel)
    marker = torch.zeros(1)
    for variant in range(8):
        kwargs = {n: 16 for n in const if n not in kernel.values}
        kwargs["num_warps"] = 4
        for i, name in enumerate(runtime):
            if name.isupper():  # a pointer
                kwargs[name] = marker if (variant >> (i % 3)) & 1 or name in ("Q", "X", "SEQLENS") else None
            elif name == "softcap":
                kwargs[name] = 2.5 if variant & 1 else 0.0
            elif name in ("window_left", "window_right"):
                kwargs[name] = (-1, 0, 7)[(variant + i) % 3]
            else:
                kwargs[name] = i + variant
        grid = (3, 1 + variant, 1)
        kernel[grid](**kwargs)  # Triton's wrapper
        launch_decode._go(kernel, grid, **kwargs)
        (a_ref, kw_ref), (a_new, kw_new) = seen[-2:]
        assert a_new == a_ref and kw_new == kw_ref
        assert set(kernel.values) <= set(kw_new)


def test_eager_plan_replays_the_recorded_launches_with_new_tensors(monkeypatch):
    """``launch_decode.record_plan`` / ``Plan`` with the launches stubbed (the direct path runs on
    a GPU only): replaying a plan for new tensors of the same signature passes each kernel exactly
    the arguments a fresh call on those tensors passes, with fresh buffers in the buffer slots."""
    from flashtile.backends.triton import fastlaunch, launch_decode

    handles, seen, ran = {}, [], []

    def fake_launch(kernel, grid, kwargs):
        values = [v for _, v in sorted(kwargs.items())]
        seen.append((kernel, grid, values))
        return handles.setdefault(kernel, object()), values

    monkeypatch.setattr(fastlaunch, "_launch", fake_launch)
    monkeypatch.setattr(launch_decode, "_on_gpu", lambda x: True)  # GPU block shapes and splits
    monkeypatch.setattr(launch_decode, "num_sms", lambda device: 132)
    monkeypatch.setattr(fastlaunch, "launch_hooks_set", lambda: False)
    # a replay calls what fastlaunch.bind made of each launch: here a note of its arguments
    monkeypatch.setattr(fastlaunch, "bind", lambda compiled, grid, values: (
        lambda *args: ran.append((compiled, grid, list(args[4:]))), [None] * 4 + list(values)))
    # the stubbed kernels write no error record: nothing to wait for
    monkeypatch.setattr(launch_decode._Ring, "_wait", lambda self, slot: True)
    launch_decode._plan.cache_clear()

    def make(seed):
        gen = _seed("plan", seed)
        b, cap, h, hk, d = 2, 1024, 8, 2, 32  # 16 key tiles a row: 4 splits, so a combine
        q = torch.randn(b, 1, h, d, generator=gen)
        kc, vc = torch.randn(b, cap, hk, d, generator=gen), torch.randn(b, cap, hk, d, generator=gen)
        k, v = torch.randn(b, 1, hk, d, generator=gen), torch.randn(b, 1, hk, d, generator=gen)
        cos, sin = torch.randn(cap, 8, generator=gen), torch.randn(cap, 8, generator=gen)
        lens = torch.tensor([900, 17], dtype=torch.int32)
        return (q, kc, vc, k, v, cos, sin, lens, None, None, None, None)

    def call(t, k=None):
        return lambda: launch_decode.decode_forward(
            t[0], t[1], t[2], t[3] if k is None else k, t[4], t[5], t[6], t[7], None, None, None,
            softmax_scale=0.2, window_left=-1, window_right=0, softcap=0.0, rotary_interleaved=True,
            rotary_q_per_token=True, alibi_slopes=None, num_splits=0, tree_mask=None)

    try:
        first = make("a")
        _, plan = launch_decode.record_plan(first, call(first))
        kernels = [s[0] for s in seen]
        # append (checking the indices), rotate q, split-KV, combine
        assert plan is not None and len(plan.launches) == 4
        second = make("b")
        seen.clear()
        (want_out, want_lse), _ = launch_decode.record_plan(second, call(second))
        out, lse = plan.run(second)
        assert [r[0] for r in ran] == [handles[kn] for kn in kernels]
        region, base = launch_decode._SCRATCH[(None, None, threading.get_ident())]
        scratch = {}
        for (compiled, grid, got), (kernel, want_grid, want) in zip(ran, seen):
            assert grid == want_grid and len(got) == len(want)
            for i, (x, y) in enumerate(zip(got, want)):
                if isinstance(y, torch.Tensor) and any(y is t for t in second):
                    assert x == y.data_ptr(), f"{kernel}: argument {i} is not the caller's tensor"
                elif isinstance(y, torch.Tensor) and y.dtype == torch.int32 and y.shape == (4,):
                    # the error record: the address of a ring slot, another one than the fresh
                    # call's
                    ring = launch_decode._RINGS[y.device]
                    assert any(y is v for v in ring.views)
                    assert x in ring.addrs and x != y.data_ptr()
                elif isinstance(y, torch.Tensor) and (y is want_out or y is want_lse):
                    # an output: the address of the tensor the replay returns
                    assert x == (out if y is want_out else lse).data_ptr()
                elif isinstance(y, torch.Tensor):
                    # a buffer the call does not return (partials, the append's verdict, the
                    # rotated q): an aligned address in the stream's scratch region, the same
                    # one wherever the fresh call used the same buffer
                    size = y.numel() * y.element_size()
                    assert isinstance(x, int) and base <= x and x + size <= base + region.numel()
                    assert (x - base) % launch_decode.SCRATCH_ALIGN == 0
                    assert scratch.setdefault(id(y), (x, size)) == (x, size)
                else:
                    assert x == y, f"{kernel}: argument {i}: {x!r} != {y!r}"
        assert out.shape == want_out.shape and out.dtype == want_out.dtype
        assert lse.shape == want_lse.shape and lse.dtype == want_lse.dtype
        assert all(t is None or t.data_ptr() not in (out.data_ptr(), lse.data_ptr())
                   for t in first + second)
        # partials, verdict and rotated q: four scratch buffers, none overlapping another
        spans = sorted(scratch.values())
        assert len(spans) == 4
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
        # a kernel argument that is neither an input nor a buffer (a converted copy): no plan
        assert launch_decode.record_plan(second, call(second, k=second[3].clone()))[1] is None
        # one tensor passed as two inputs: a later call may pass two, so no plan
        aliased = second[:2] + (second[1],) + second[3:]
        assert launch_decode.record_plan(aliased, call(aliased))[1] is None
        # a launch that did not go direct: no plan
        monkeypatch.setattr(fastlaunch, "_launch", lambda *a: None)
        assert launch_decode.record_plan(second, call(second))[1] is None
    finally:
        launch_decode._plan.cache_clear()


def test_replay_scratch_is_per_thread_and_reused(monkeypatch):
    """``launch_decode._scratch``: one region per (device, stream, thread), reused by the same
    thread (grown when a replay needs more), another for another thread on the same stream
    (two threads' launches may interleave on one stream); past the region count, a replay gets
    a region of its own that it keeps alive."""
    from flashtile.backends.triton import launch_decode

    monkeypatch.setattr(launch_decode, "_SCRATCH", {})
    cpu = torch.device("cpu")
    a, held = launch_decode._scratch(cpu, None, 7, 1024)
    assert held is None and launch_decode._scratch(cpu, None, 7, 512) == (a, None)
    other = []
    worker = threading.Thread(target=lambda: other.append(launch_decode._scratch(cpu, None, 7, 1024)))
    worker.start()
    worker.join()
    assert other[0][1] is None and other[0][0] != a
    grown, _ = launch_decode._scratch(cpu, None, 7, 4096)
    assert launch_decode._SCRATCH[(None, 7, threading.get_ident())][0].numel() == 4096
    assert launch_decode._scratch(cpu, None, 7, 4096) == (grown, None)
    big, keep = launch_decode._scratch(cpu, None, 7, launch_decode.SCRATCH_LIMIT + 1)
    assert keep is not None and keep.data_ptr() == big
    monkeypatch.setattr(launch_decode, "SCRATCH_REGIONS", len(launch_decode._SCRATCH))
    own, keep = launch_decode._scratch(cpu, None, 8, 256)  # a new stream, no region left
    assert keep is not None and keep.data_ptr() == own and (None, 8, threading.get_ident()) not in launch_decode._SCRATCH


def test_eager_plans_only_for_cuda_triton_calls():
    from flashtile.kvcache import _eager_plan_key

    t = torch.zeros(1, 1, 2, 16)
    args = (t, t, t, None, None, None, None, torch.zeros(1, dtype=torch.int32), None, None, None, None)
    assert _eager_plan_key(args, (None, False, (-1, -1), 0.0, True, 0)) is None


def test_eager_plan_key_separates_what_the_launches_depend_on(monkeypatch):
    """``kvcache._eager_plan_key`` with CPU tensors standing in for CUDA ones: equal keys for
    calls that launch the same kernels with the same arguments, different keys for another
    shape, stride, dtype, alignment, scalar type or check mode, and no key where an argument
    would be keyed by identity (a tensor scale or window) or is not a tensor where one belongs."""
    from flashtile import kvcache

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kvcache.backends, "select", lambda device: "triton")
    monkeypatch.setattr(kvcache, "_plans_enabled", lambda: True)
    mode = ["async"]
    monkeypatch.setattr(kvcache, "_check_mode", lambda: mode[0])
    gen = _seed("plan-key")

    def args(q=None, lens=None, table=None):
        q = torch.randn(2, 1, 4, 16, generator=gen) if q is None else q
        kc, vc = (torch.randn(2, 64, 2, 16, generator=gen) for _ in range(2))
        lens = torch.tensor([3, 9], dtype=torch.int32) if lens is None else lens
        return (q, kc, vc, None, None, None, None, lens, None, None, table, None)

    scalars = (None, True, (-1, -1), 0.0, True, 0)
    key = kvcache._eager_plan_key(args(), scalars)
    assert key is not None and hash(key) is not None
    assert kvcache._eager_plan_key(args(), scalars) == key  # fresh tensors, same signature
    assert kvcache._eager_plan_key(args(), scalars[:2] + ([-1, -1],) + scalars[3:]) == key
    wide = torch.randn(2, 1, 8, 16, generator=gen)
    different = {
        "shape": (args(q=torch.randn(3, 1, 4, 16, generator=gen)), scalars),
        "stride": (args(q=wide[:, :, ::2]), scalars),
        "dtype": (args(q=torch.randn(2, 1, 4, 16, generator=gen).double()), scalars),
        "alignment": (args(q=torch.randn(2 * 64 + 1, generator=gen)[1:].view(2, 1, 4, 16)), scalars),
        "causal 1": (args(), (None, 1, (-1, -1), 0.0, True, 0)),
        "softcap 0": (args(), (None, True, (-1, -1), 0, True, 0)),
        "window": (args(), (None, True, (8, 0), 0.0, True, 0)),
        "scale": (args(), (0.25, True, (-1, -1), 0.0, True, 0)),
    }
    keys = {name: kvcache._eager_plan_key(*a) for name, a in different.items()}
    assert all(k is not None and k != key for k in keys.values()), keys
    assert len(set(keys.values())) == len(keys)
    mode[0] = "off"
    assert kvcache._eager_plan_key(args(), scalars) not in (None, key)
    for name, a in {
        "tensor scale": (args(), (torch.tensor(0.25),) + scalars[1:]),
        "tensor window": (args(), scalars[:2] + ((torch.tensor(4), 0),) + scalars[3:]),
        "int cache_seqlens": (args(lens=5), scalars),
        "list block_table": (args(table=[[0, 1]]), scalars),
    }.items():
        assert kvcache._eager_plan_key(*a) is None, name


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    assert select_decode_backend(cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    assert select_decode_backend(cpu) == "triton"
    monkeypatch.setenv("FLASHTILE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FLASHTILE_BACKEND"):
        select_decode_backend(cpu)
    monkeypatch.delenv("FLASHTILE_BACKEND")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select_decode_backend(cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_decode_backend(cpu) == "triton"


def test_paged_helpers_roundtrip():
    gen = _seed("paged-helpers")
    cache = torch.randn(3, 64, 2, 8, generator=gen)
    paged, table = paged_kv.contiguous_to_paged(cache, 16, num_blocks=15, generator=gen)
    assert table.dtype == torch.int32 and table.shape == (3, 4)
    assert torch.equal(paged_kv.paged_to_contiguous(paged, table), cache)
    assert torch.equal(paged_kv.gather_kv(paged, 5, 40, row=1, block_table=table), cache[1, 5:40])
    new = torch.randn(7, 2, 8, generator=gen)
    paged_kv.scatter_kv(paged, new, 30, row=2, block_table=table)
    assert torch.equal(paged_kv.gather_kv(paged, 30, 37, row=2, block_table=table), new)
    with pytest.raises(ValueError, match="page_size"):
        paged_kv.contiguous_to_paged(cache, 8)


# --------------------------------------------------------------------------------------------
# bad input: clear errors, raised before anything is written
# --------------------------------------------------------------------------------------------
def _i32(*v):
    return torch.tensor(v, dtype=torch.int32)


BAD = {
    # name: (mutate(kwargs, inp) -> None, exception, message fragment)
    "block-table-out-of-range": (lambda kw, i: kw["block_table"].__setitem__((1, 0), 999), ValueError, "block_table"),
    "block-table-negative": (lambda kw, i: kw["block_table"].__setitem__((0, 0), -1), ValueError, "block_table"),
    "block-table-int64": (lambda kw, i: kw.update(block_table=kw["block_table"].long()), TypeError, "block_table"),
    "block-table-batch": (lambda kw, i: kw.update(block_table=kw["block_table"][:1]), ValueError, "block_table"),
    "page-size-8": ("page8", ValueError, "page_size"),
    "seqlens-overflow": (lambda kw, i: kw.update(cache_seqlens=_i32(10, 64)), ValueError, "cache_seqlens"),
    "seqlens-int-overflow": (lambda kw, i: kw.update(cache_seqlens=64), ValueError, "cache_seqlens"),
    "seqlens-none-with-append": (lambda kw, i: kw.update(cache_seqlens=None), ValueError, "capacity"),
    "seqlens-negative": (lambda kw, i: kw.update(cache_seqlens=_i32(-1, 3)), ValueError, "cache_seqlens"),
    "seqlens-int64": (lambda kw, i: kw.update(cache_seqlens=kw["cache_seqlens"].long()), TypeError, "cache_seqlens"),
    "seqlens-shape": (lambda kw, i: kw.update(cache_seqlens=_i32(3)), ValueError, "cache_seqlens"),
    "seqlens-float": (lambda kw, i: kw.update(cache_seqlens=3.0), TypeError, "cache_seqlens"),
    "batch-idx-with-paged": (lambda kw, i: kw.update(cache_batch_idx=_i32(0, 1)), ValueError, "cache_batch_idx"),
    "leftpad-int64": (lambda kw, i: kw.update(cache_leftpad=torch.tensor([0, 1])), TypeError, "cache_leftpad"),
    "leftpad-past-seqlens": (lambda kw, i: kw.update(cache_leftpad=_i32(0, 40)), ValueError, "cache_leftpad"),
    "k-without-v": (lambda kw, i: kw.update(v=None), ValueError, "k and v"),
    "k-wrong-heads": (lambda kw, i: kw.update(k=torch.randn(2, 1, 4, 16), v=torch.randn(2, 1, 4, 16)), ValueError, "k must"),
    "k-dtype": (lambda kw, i: kw.update(k=kw["k"].half()), TypeError, "k has dtype"),
    "v-shape": (lambda kw, i: kw.update(v=torch.randn(2, 2, 2, 16)), ValueError, "v shape"),
    "rotary-cos-only": (lambda kw, i: kw.update(rotary_cos=torch.ones(80, 4)), ValueError, "rotary_sin"),
    "rotary-dim-too-big": (lambda kw, i: kw.update(rotary_cos=torch.ones(80, 9), rotary_sin=torch.ones(80, 9)), ValueError, "rotary_dim"),
    "rotary-table-short": (lambda kw, i: kw.update(rotary_cos=torch.ones(20, 4), rotary_sin=torch.ones(20, 4)), ValueError, "rotary_cos"),
    "rotary-without-k": (lambda kw, i: kw.update(k=None, v=None, rotary_cos=torch.ones(80, 4), rotary_sin=torch.ones(80, 4)), ValueError, "rotary"),
    "rotary-dtype-mismatch": (lambda kw, i: kw.update(rotary_cos=torch.ones(80, 4), rotary_sin=torch.ones(80, 4).half()), TypeError, "rotary_sin"),
    "alibi-shape": (lambda kw, i: kw.update(alibi_slopes=torch.rand(3)), ValueError, "alibi_slopes"),
    "alibi-dtype": (lambda kw, i: kw.update(alibi_slopes=torch.rand(4).half()), TypeError, "alibi_slopes"),
    "tree-shape": (lambda kw, i: kw.update(tree_mask=torch.ones(1, 2, 2, dtype=torch.bool)), ValueError, "tree_mask"),
    "tree-dtype": (lambda kw, i: kw.update(tree_mask=torch.ones(1, 1, 1, dtype=torch.int32)), TypeError, "tree_mask"),
    "tree-packed-shape": (lambda kw, i: kw.update(tree_mask=torch.ones(3, 1, dtype=torch.int64)), ValueError, "tree_mask"),
    "window-size": (lambda kw, i: kw.update(window_size=(1, 2, 3)), ValueError, "window_size"),
    "softcap-negative": (lambda kw, i: kw.update(softcap=-1.0), ValueError, "softcap"),
    "num-splits-too-many": (lambda kw, i: kw.update(num_splits=1000), ValueError, "num_splits"),
    "num-splits-negative": (lambda kw, i: kw.update(num_splits=-1), ValueError, "num_splits"),
    "q-int": ("q-int", TypeError, "q must"),
    "q-3d": ("q-3d", ValueError, "q must"),
    "q-headdim": ("q-headdim", ValueError, "headdim"),
    "cache-dtype": ("cache-dtype", TypeError, "k_cache has dtype"),
    "cache-shape-mismatch": ("v-cache-shape", ValueError, "v_cache shape"),
    "cache-3d": ("cache-3d", ValueError, "k_cache"),
    "cache-device": ("cache-meta", ValueError, "v_cache is on meta"),
    "cache-last-dim-strided": ("cache-strided", ValueError, "contiguous last dimension"),
    "nheads-not-multiple": ("q-heads", ValueError, "multiple of nheads_k"),
}
BAD_CONTIG = {
    "contig-batch-mismatch": (lambda kw, i: None, ValueError, "cache_batch_idx"),
    "batch-idx-out-of-range": (lambda kw, i: kw.update(cache_batch_idx=_i32(0, 5)), ValueError, "cache_batch_idx"),
    "batch-idx-int64": (lambda kw, i: kw.update(cache_batch_idx=torch.tensor([0, 1])), TypeError, "cache_batch_idx"),
}


# the cases whose bad value is in an index tensor: the Triton path finds them on the device
VALUE_ERRORS = {"block-table-out-of-range", "block-table-negative", "seqlens-overflow",
                "seqlens-negative", "leftpad-past-seqlens", "rotary-table-short",
                "batch-idx-out-of-range"}


def _bad_setup(kind: str):
    gen = _seed("bad", kind)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    if kind == "contig":
        kc = torch.randn(3, 64, 2, 16, generator=gen)
        bt = None
    else:
        kc = torch.randn(9, 16, 2, 16, generator=gen)
        bt = torch.randperm(9, generator=gen)[:8].reshape(2, 4).to(torch.int32)
    vc = torch.randn(kc.shape, generator=gen)
    kw = dict(k=torch.randn(2, 1, 2, 16, generator=gen), v=torch.randn(2, 1, 2, 16, generator=gen),
              cache_seqlens=_i32(10, 30), block_table=bt)
    return q, kc, vc, kw


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("name", list(BAD) + list(BAD_CONTIG))
def test_bad_input_raises_before_writing(backend, name):
    contig = name in BAD_CONTIG
    mutate, err, fragment = (BAD_CONTIG if contig else BAD)[name]
    q, kc, vc, kw = _bad_setup("contig" if contig else "paged")
    if contig and name != "contig-batch-mismatch":
        kw["cache_batch_idx"] = _i32(2, 0)
    if callable(mutate):
        mutate(kw, None)
    elif mutate == "page8":
        kc, vc = kc.reshape(18, 8, 2, 16), vc.reshape(18, 8, 2, 16)
    elif mutate == "q-int":
        q = q.to(torch.int32)
    elif mutate == "q-3d":
        q = q[0]
    elif mutate == "q-headdim":
        q = torch.randn(2, 1, 4, 8)
    elif mutate == "q-heads":
        q = torch.randn(2, 1, 3, 16)
    elif mutate == "cache-dtype":
        kc, vc = kc.half(), vc.half()
    elif mutate == "v-cache-shape":
        vc = vc[:, :8]
    elif mutate == "cache-3d":
        kc, vc = kc[0], vc[0]
    elif mutate == "cache-meta":
        vc = torch.empty(vc.shape, device="meta")
    elif mutate == "cache-strided":
        kc = torch.randn(kc.shape[:-1] + (32,))[..., ::2]
    k_before, v_before = kc.clone(), vc.clone()
    if backend == "triton" and name in VALUE_ERRORS:
        # index values are checked on the device: the call returns NaN and writes nothing, and
        # the error comes at the next check (FLASHTILE_KVCACHE_CHECK=async, the default)
        out = flash_attn_with_kvcache(q, kc, vc, **kw)
        assert out.isnan().all()
        with pytest.raises(err, match=fragment):
            flashtile.check_kvcache_errors()
    else:
        with pytest.raises(err, match=fragment):
            flash_attn_with_kvcache(q, kc, vc, **kw)
    if kc.device.type != "meta" and vc.device.type != "meta":
        assert torch.equal(kc, k_before) and torch.equal(vc, v_before)


def test_packed_tree_mask_limited_to_64_tokens():
    q = torch.randn(1, 65, 2, 16)
    kc = torch.randn(1, 80, 2, 16)
    with pytest.raises(ValueError, match="at most 64"):
        flash_attn_with_kvcache(q, kc, kc.clone(), tree_mask=torch.ones(1, 65, dtype=torch.int64))


# --------------------------------------------------------------------------------------------
# index values on the Triton path: checked on the device, raised without a host wait
# --------------------------------------------------------------------------------------------
TRITON_ONLY = pytest.mark.skipif(not INTERP, reason=f"runs in the TRITON_INTERPRET=1 child process ({SUBPROCESS_TEST})")
CHECK_CASES = {
    # name: (paged, append, change of the call's arguments, message, batch row that is bad)
    "page-99-append": (True, True, dict(block_table=_i32(0, 1, 2, 3, 99, 5).reshape(2, 3)),
                       r"block_table\[1, 1\]=99 is not a page", 1),
    "page-negative-attend": (True, False, dict(block_table=_i32(-2, 1, 2, 3, 4, 5).reshape(2, 3)),
                             r"block_table\[0, 0\]=-2 is not a page", 0),
    "page-99-attend-splits": (True, False, dict(block_table=_i32(0, 1, 2, 3, 99, 5).reshape(2, 3),
                                                num_splits=3),
                              r"block_table\[1, 1\]=99 is not a page", 1),
    "seqlens-past-table-append": (True, True, dict(cache_seqlens=_i32(10, 48)),
                                  r"cache_seqlens\[1\]=48 \+ 1 new tokens exceeds", 1),
    "seqlens-negative-attend": (False, False, dict(cache_seqlens=_i32(-1, 30)),
                                r"cache_seqlens\[0\]=-1 must be >= 0", 0),
    "leftpad-append": (False, True, dict(cache_leftpad=_i32(0, 40)),
                       r"cache_leftpad\[1\]=40 must be in", 1),
    "batch-idx-attend": (False, False, dict(cache_batch_idx=_i32(5, 1)),
                         r"cache_batch_idx\[0\]=5", 0),
    "rotary-short-append": (True, True, dict(rotary_cos=torch.ones(20, 4), rotary_sin=torch.zeros(20, 4)),
                            r"rotary_cos/rotary_sin have 20 positions .*cache_seqlens\[1\]=30", 1),
}


def _check_setup(paged: bool, append: bool, seed: str):
    """``(q, k_cache, v_cache, kwargs)`` of a valid call: batch 2, lengths 10 and 30, six pages
    of 16 slots (paged) or two rows of 48."""
    gen = _seed("check", seed)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    if paged:
        kc, bt = torch.randn(6, 16, 2, 16, generator=gen), _i32(0, 1, 2, 3, 4, 5).reshape(2, 3)
    else:
        kc, bt = torch.randn(2, 48, 2, 16, generator=gen), None
    kw = dict(cache_seqlens=_i32(10, 30), block_table=bt, return_softmax_lse=True)
    if append:
        kw.update(k=torch.randn(2, 1, 2, 16, generator=gen), v=torch.randn(2, 1, 2, 16, generator=gen))
    return q, kc, torch.randn(kc.shape, generator=gen), kw


@pytest.fixture
def check_mode(monkeypatch):
    """Set FLASHTILE_KVCACHE_CHECK for one test (unset: the default, ``async``)."""
    monkeypatch.delenv("FLASHTILE_KVCACHE_CHECK", raising=False)
    monkeypatch.delenv("FLASHTILE_CHECK_INDICES", raising=False)
    return lambda mode: monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", mode)


@TRITON_ONLY
@pytest.mark.parametrize("path", ["fused", "check-kernel"])
@pytest.mark.parametrize("name", list(CHECK_CASES))
def test_async_check_raises_at_the_next_call(name, path, check_mode, monkeypatch):
    """Default mode: the bad call returns without waiting, writes nothing into the caches and
    its output is NaN (every row when it appends, the bad row's otherwise); the next call on the
    device raises the error (argument, row, value) before it runs; calls after that run
    normally.  ``check-kernel``: the one-program check kernel that precedes large appends."""
    from flashtile.backends.triton import launch_decode

    if path == "check-kernel":
        monkeypatch.setattr(launch_decode, "FUSED_CHECK_BUDGET", 0)
    paged, append, change, message, bad_row = CHECK_CASES[name]
    q, kc, vc, kw = _check_setup(paged, append, name)
    if name.startswith("rotary") or name.startswith("leftpad") or name.startswith("batch"):
        kw.update({k: v for k, v in dict(rotary_cos=torch.ones(80, 4), rotary_sin=torch.zeros(80, 4),
                                         cache_leftpad=_i32(0, 0), cache_batch_idx=_i32(0, 1)).items()
                   if k in change})
    with flashtile.use_backend("triton"):
        good_kc, good_vc = kc.clone(), vc.clone()
        want, want_lse = flash_attn_with_kvcache(q, good_kc, good_vc, **kw)
        assert not want.isnan().any()
        k_bad, v_bad = kc.clone(), vc.clone()
        out, lse = flash_attn_with_kvcache(q, k_bad, v_bad, **{**kw, **change})
        assert torch.equal(k_bad, kc) and torch.equal(v_bad, vc), "a bad call wrote into the cache"
        if append:
            assert out.isnan().all() and lse.isnan().all()
        else:
            assert out[bad_row].isnan().all() and lse[bad_row].isnan().all()
            good = 1 - bad_row
            torch.testing.assert_close(out[good], want[good], rtol=0, atol=0)
        k_next, v_next = kc.clone(), vc.clone()
        with pytest.raises(flashtile.FlashtileInputError, match=message) as info:
            flash_attn_with_kvcache(q, k_next, v_next, **kw)
        assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
        assert "an earlier flash_attn_with_kvcache call" in str(info.value)
        assert "this call did not run" in str(info.value)
        assert torch.equal(k_next, kc) and torch.equal(v_next, vc), "the raising call ran"
        # reported once: the calls after it run normally
        again_k, again_v = kc.clone(), vc.clone()
        got, got_lse = flash_attn_with_kvcache(q, again_k, again_v, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)
    assert torch.equal(again_k, good_kc) and torch.equal(again_v, good_vc)
    flashtile.check_kvcache_errors()


@TRITON_ONLY
@pytest.mark.parametrize("name", ["page-99-append", "seqlens-negative-attend"])
def test_async_check_raises_at_check_kvcache_errors(name, check_mode):
    """With no later call, ``check_kvcache_errors()`` waits and raises the error; once."""
    paged, append, change, message, _ = CHECK_CASES[name]
    q, kc, vc, kw = _check_setup(paged, append, name)
    with flashtile.use_backend("triton"):
        flash_attn_with_kvcache(q, kc, vc, **{**kw, **change})
        with pytest.raises(flashtile.FlashtileInputError, match=message) as info:
            flashtile.check_kvcache_errors()
        assert "this call did not run" not in str(info.value)
        flashtile.check_kvcache_errors()
        flashtile.check_kvcache_errors("cpu")


@TRITON_ONLY
@pytest.mark.parametrize("name", ["page-99-append", "seqlens-past-table-append", "batch-idx-attend"])
def test_sync_check_raises_in_the_call(name, check_mode):
    """``FLASHTILE_KVCACHE_CHECK=sync`` (flash-attn's behaviour): the call itself raises, as a
    ``RuntimeError`` too, and the cache is untouched; later calls run normally."""
    check_mode("sync")
    paged, append, change, message, _ = CHECK_CASES[name]
    q, kc, vc, kw = _check_setup(paged, append, name)
    k_bad, v_bad = kc.clone(), vc.clone()
    with flashtile.use_backend("triton"):
        with pytest.raises(RuntimeError, match=message):
            flash_attn_with_kvcache(q, k_bad, v_bad, **{**kw, **change})
        assert torch.equal(k_bad, kc) and torch.equal(v_bad, vc)
        out, _ = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **kw)
    assert not out.isnan().any()
    flashtile.check_kvcache_errors()


@TRITON_ONLY
@pytest.mark.parametrize("spelling", ["FLASHTILE_KVCACHE_CHECK=off", "FLASHTILE_CHECK_INDICES=0"])
def test_check_off_raises_nothing_and_keeps_the_guards(spelling, check_mode, monkeypatch):
    """Checks off: no error ever, no NaN; the guards still drop the append past what row 1's
    block table addresses, and row 0's valid append lands."""
    var, value = spelling.split("=")
    monkeypatch.setenv(var, value)
    q, kc, vc, kw = _check_setup(True, True, "off")
    k_cache, v_cache = kc.clone(), vc.clone()
    with flashtile.use_backend("triton"):
        out, _ = flash_attn_with_kvcache(q, k_cache, v_cache, **{**kw, "cache_seqlens": _i32(10, 48)})
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **kw)
    flashtile.check_kvcache_errors()
    assert not out.isnan().any()
    want_k, want_v = kc.clone(), vc.clone()
    want_k[0, 10], want_v[0, 10] = kw["k"][0, 0], kw["v"][0, 0]  # row 0: page 0, slot 10
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_check_mode_rejects_unknown_values(monkeypatch):
    from flashtile.backends.triton.launch_decode import check_mode

    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "later")
    with pytest.raises(ValueError, match="FLASHTILE_KVCACHE_CHECK"):
        check_mode()
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "sync")
    monkeypatch.setenv("FLASHTILE_CHECK_INDICES", "0")
    assert check_mode() == "sync"  # the new variable wins
    monkeypatch.delenv("FLASHTILE_KVCACHE_CHECK")
    assert check_mode() == "off"
    monkeypatch.delenv("FLASHTILE_CHECK_INDICES")
    assert check_mode() == "async"


@TRITON_ONLY
def test_captured_call_keeps_a_replay_error_for_check_kvcache_errors(check_mode, monkeypatch):
    """A call captured in a CUDA graph (capture emulated: the record is a slot of its own,
    written only on an error): a later eager call raises nothing for it, ``check_kvcache_errors``
    does, once; a captured call with valid indices reports nothing."""
    from flashtile.backends.triton import launch_decode

    q, kc, vc, kw = _check_setup(True, True, "graph")
    bad = dict(block_table=_i32(0, 1, 2, 3, 99, 5).reshape(2, 3))
    with flashtile.use_backend("triton"):
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **kw)  # the ring exists before capture
        monkeypatch.setattr(launch_decode, "_capturing", lambda device: True)
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **kw)
        k_bad = kc.clone()
        out, _ = flash_attn_with_kvcache(q, k_bad, vc.clone(), **{**kw, **bad})
        monkeypatch.setattr(launch_decode, "_capturing", lambda device: False)
        assert out.isnan().all() and torch.equal(k_bad, kc)
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **kw)
        with pytest.raises(flashtile.FlashtileInputError,
                           match=r"captured in a CUDA graph .*block_table\[1, 1\]=99"):
            flashtile.check_kvcache_errors()
        flashtile.check_kvcache_errors()


def test_error_ring_retires_in_order_and_waits_when_full(monkeypatch):
    """The host side of the records, with a device that writes them late (emulated): an error is
    raised once every older record is written, by the first call that finds it so; a call that
    finds the ring full waits for the oldest record."""
    from flashtile.backends.triton import launch_decode
    from flashtile.backends.triton.kernels.decode import RECORD_DONE

    done = RECORD_DONE.value
    ring = launch_decode._Ring(torch.device("cpu"))
    ring.synchronous = False
    ring.SLOTS = 4
    info = (True, 1, 48, 3, 16, 6, 0, 1)  # paged, 1 new token, capacity 48, 3 columns, 6 pages
    waited = []

    def device_writes(slot):  # the device gets to the oldest record while the host waits
        waited.append(slot)
        ring.words[slot, 0] = done
        return True

    monkeypatch.setattr(ring, "_wait", device_writes)
    s0, s1 = ring.begin(info)[1], ring.begin(info)[1]
    ring.words[s1] = (done + 5, 4, 99, 0)  # call 1 found block_table[1, 1] = 99; call 0 runs on
    assert ring.begin(info)[1] == 2  # nothing raised: call 0's record is not written yet
    ring.words[s0, 0] = done
    with pytest.raises(flashtile.FlashtileInputError, match=r"block_table\[1, 1\]=99"):
        ring.begin(info)
    assert ring.pending() == [2]
    assert [ring.begin(info)[0] for _ in range(3)] == [3, 4, 5]  # the ring is full now
    assert ring.begin(info)[0] == 6 and waited == [2]
    ring.check()  # the emulated device wrote nothing else: no error, nothing pending
    assert ring.pending() == []


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_merge_attention_states_nan_lse_makes_the_row_nan(backend):
    """A NaN partial lse (a split that read a bad index) gives a NaN row, not a dropped side."""
    gen = _seed("merge-nan")
    oa, ob = torch.randn(1, 2, 3, 16, generator=gen), torch.randn(1, 2, 3, 16, generator=gen)
    la, lb = torch.randn(1, 3, 2, generator=gen), torch.randn(1, 3, 2, generator=gen)
    la[0, 1, 0] = NAN
    out, lse = merge_attention_states(oa, la, ob, lb)
    nan_row = torch.zeros(1, 3, 2, dtype=torch.bool)
    nan_row[0, 1, 0] = True
    assert torch.equal(lse.isnan(), nan_row)
    assert torch.equal(out.isnan().all(-1), nan_row.transpose(1, 2)) and out.isnan().sum() == 16


# --------------------------------------------------------------------------------------------
# the Triton kernels, emulated by the interpreter in a child process
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(INTERP, reason="this process already runs the triton tests under the interpreter")
def test_triton_kernels_under_interpreter():
    proc, log = _CHILD.get("proc"), _CHILD.get("log")
    assert proc is not None, "the interpreter child was not started"
    try:
        rc = proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    log.seek(0)
    text = log.read()
    assert rc == 0, f"triton tests under TRITON_INTERPRET=1 failed (rc={rc}):\n{text[-20000:]}"
    assert " passed" in text and " failed" not in text, text[-2000:]
