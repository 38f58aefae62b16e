"""Context parallelism: the partial-attention entry point (global offsets, both backends) and
``flashtile.distributed`` on gloo process groups of 2 and 4 CPU ranks (one spawn per world size,
every case run inside it), each against float64 attention on the whole sequence (flash-attn's
error rule) and against one ``flash_attn_func`` call on the whole sequence, with the
collectives each mode issues counted."""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

import flashtile
from flashtile.backends.triton.fastlaunch import poison_outputs
from flashtile.distributed import partial_attention, partial_attention_backward
from flashtile.rng import keep_mask

from helpers import assert_close, assert_flash_rule, check_flash_rule, next_seed, randn
from helpers import math_attention

# ---------------------------------------------------------------------------------------
# partial attention: blocks of one sequence at their global offsets

PARTIAL_CASES = {
    "causal": dict(causal=True),
    "window-alibi-softcap": dict(window_size=(6, 3), alibi=True, softcap=5.0),
    "causal-dropout": dict(causal=True, dropout_p=0.25),
}


def _restricted_ref(q, k, v, q_rows, k_cols, causal, window_size, softcap, slopes, keep, p,
                    dtype):
    """Rows ``q_rows`` of attention over the whole sequence with only the keys ``k_cols``
    visible (an additive -inf bias hides the others): what a partial call must return."""
    S = k.shape[1]
    bias = torch.full((1, 1, q.shape[1], S), float("-inf"), dtype=dtype)
    bias[..., k_cols] = 0.0
    wl, wr = window_size
    out, lse = math_attention(q.to(dtype), k.to(dtype), v.to(dtype), window_left=wl,
                              window_right=0 if causal else wr, softcap=softcap,
                              alibi_slopes=slopes, attn_bias=bias, dropout_mask=keep,
                              dropout_p=p)
    return out[:, q_rows], lse[:, :, q_rows]


# every case on the torch engine in fp32 and fp16; the Triton kernels (interpreted, slow) in
# fp32, and in fp16 with dropout
PARTIAL_RUNS = [(c, b, d) for c in PARTIAL_CASES for b in ("triton", "torch")
                for d in ("fp32", "fp16") if b == "torch" or d == "fp32" or c == "causal-dropout"]


@pytest.mark.parametrize("case,backend,dtype", PARTIAL_RUNS,
                         ids=["-".join(r) for r in PARTIAL_RUNS])
def test_partials_at_offsets_equal_slices_of_the_whole_call(case, backend, dtype):
    dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    c = PARTIAL_CASES[case]
    causal, window = c.get("causal", False), c.get("window_size", (-1, -1))
    softcap, p = c.get("softcap", 0.0), c.get("dropout_p", 0.0)
    B, S, H, Hk, D = 2, 40, 4, 2, 16
    q, k, v, do = (randn(B, S, h, D, dtype=dtype) for h in (H, Hk, Hk, H))
    slopes = torch.rand(B, H) * 0.5 if c.get("alibi") else None
    seed = torch.tensor([next_seed()]) if p else None
    keep = keep_mask(int(seed[0]), p, B, H, S, S) if p else None
    kw = dict(seqlen_q_total=S, seqlen_k_total=S, causal=causal, window_size=window,
              softcap=softcap, alibi_slopes=slopes, dropout_p=p, rng_seed=seed)
    q_slices, k_blocks = [(0, 17), (17, 40)], [(0, 11), (11, 40)]
    grads = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
    leaves64 = [x.double().requires_grad_() for x in (q, k, v)]
    whole64 = _restricted_ref(*leaves64, slice(0, S), slice(0, S), causal, window, softcap,
                              slopes, keep, p, torch.float64)[0]
    whole_low = _restricted_ref(q, k, v, slice(0, S), slice(0, S), causal, window, softcap,
                                slopes, keep, p, dtype)[0]
    with flashtile.use_backend(backend), poison_outputs():
        for q0, q1 in q_slices:
            merged = None
            for k0, k1 in k_blocks:
                out, lse = partial_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], q_offset=q0,
                                             k_offset=k0, **kw)
                assert out.dtype == torch.float32 and lse.shape == (B, H, q1 - q0)
                want64, lse64 = _restricted_ref(q, k, v, slice(q0, q1), slice(k0, k1), causal,
                                                window, softcap, slopes, keep, p, torch.float64)
                base, _ = _restricted_ref(q, k, v, slice(q0, q1), slice(k0, k1), causal, window,
                                          softcap, slopes, keep, p, dtype)
                name = f"{case} q[{q0}:{q1}] k[{k0}:{k1}]"
                assert_flash_rule(f"{name} out", out, want64, base, 2, 1e-4)
                assert_close(f"{name} lse", lse, lse64, atol=1e-4, rtol=1e-5)
                merged = (out, lse) if merged is None else flashtile.merge_attention_states(
                    merged[0], merged[1], out, lse)
            rows = slice(q0, q1)
            assert_flash_rule(f"{case} q[{q0}:{q1}] merged", merged[0], whole64[:, rows],
                              whole_low[:, rows], 2, 1e-4)
            for k0, k1 in k_blocks:
                g = partial_attention_backward(
                    do[:, rows], q[:, rows], k[:, k0:k1], v[:, k0:k1], merged[0].to(dtype),
                    merged[1], q_offset=q0, k_offset=k0, **kw)
                grads[0][:, rows] += g[0]
                grads[1][:, k0:k1] += g[1]
                grads[2][:, k0:k1] += g[2]
    want = torch.autograd.grad(whole64, leaves64, do.double())
    leaves_low = [x.clone().requires_grad_() for x in (q, k, v)]
    low = _restricted_ref(*leaves_low, slice(0, S), slice(0, S), causal, window, softcap, slopes,
                          keep, p, dtype)[0]
    base = torch.autograd.grad(low, leaves_low, do)
    for name, got, w, b in zip(("dq", "dk", "dv"), grads, want, base):
        assert_flash_rule(f"{case} summed shares {name}", got, w, b, 3, 1e-4)


def test_partial_offsets_are_validated():
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="k_offset"):
        partial_attention(q, q, q, k_offset=4, seqlen_k_total=10)
    with pytest.raises(ValueError, match="q_offset"):
        partial_attention(q, q, q, q_offset=-1)
    with pytest.raises(ValueError, match="rng_seed"):
        partial_attention(q, q, q, dropout_p=0.1)


PLAIN_CASES = {"causal": dict(causal=True), "full": {}, "window-right": dict(window=(-1, 3)),
               "causal-softcap": dict(causal=True, softcap=4.0)}
# every case on the torch engine; the Triton kernels (interpreted, slow) on two
PLAIN_RUNS = [(c, b) for c in PLAIN_CASES for b in ("torch", "triton")
              if b == "torch" or c in ("causal", "window-right")]


@pytest.mark.parametrize("case,backend", PLAIN_RUNS, ids=["-".join(r) for r in PLAIN_RUNS])
def test_plain_blocks_equal_attention_over_their_global_keys(case, backend):
    """Every block the context-parallel modes run as a plain call (``_pairs``: the ring's key
    pieces of each rank, zigzag and contiguous, and the all-gather's whole sequence, over
    world sizes 2 and 4) returns the output and LSE of its queries' global rows over only its
    keys' global positions, with the whole sequence's mask (float32 attention on the whole
    sequence with the other keys hidden).  Without a window every block is a plain call."""
    from flashtile.distributed import _Cfg, _block_forward, _pairs, pieces
    c = PLAIN_CASES[case]
    B, S, H, Hk, D = 1, 32, 2, 1, 16
    q, k, v = (randn(B, S, h, D) for h in (H, Hk, Hk))
    window = c.get("window", (-1, -1))
    worlds = (2, 4) if backend == "torch" else (2,)
    plain = 0
    with flashtile.use_backend(backend), poison_outputs():
        for world, layout in ((w, lay) for w in worlds for lay in ("zigzag", "contiguous")):
            n = S // world
            cfg = _Cfg(world, 0, None, layout, "ring", c.get("causal", False), D ** -0.5, window,
                       c.get("softcap", 0.0), 0.0, None, None, [(0, 0, S)], S)

            def local(x, rank):  # the rank's shard and its local -> global positions
                ps = pieces(layout, world, rank, n)
                return (torch.cat([x[:, g:g + ln] for _, g, ln in ps], dim=1),
                        [g + i for _, g, ln in ps for i in range(ln)])
            for rank in range(world):
                q_loc, rows = local(q, rank)
                key_sets = [(src, pieces(layout, world, src, n)) for src in range(world)]
                key_sets.append(("all", [(0, 0, S)]))  # the all-gather's whole sequence
                for src, k_pieces in key_sets:
                    if src == "all":
                        k_loc, v_loc, cols = k, v, list(range(S))
                    else:
                        (k_loc, cols), (v_loc, _) = local(k, src), local(v, src)
                    q_pieces = pieces(layout, world, rank, n)
                    for (ql, nq, kl, nk, q_off, k_off, b_off), spec in _pairs(cfg, q_pieces,
                                                                               k_pieces):
                        if spec is None:  # a window's edge: the partial call (tested above)
                            assert window != (-1, -1), f"{case}: a partial call, no feature"
                            continue
                        out, lse = _block_forward(cfg, q_loc[:, ql:ql + nq], k_loc[:, kl:kl + nk],
                                                  v_loc[:, kl:kl + nk], spec, q_off, k_off, b_off)
                        want, want_lse = _restricted_ref(
                            q, k, v, rows[ql:ql + nq], cols[kl:kl + nk], cfg.causal, window,
                            cfg.softcap, None, None, 0.0, torch.float32)
                        name = f"{case} w{world} {layout} rank {rank} keys {src} rows {ql}+{nq}"
                        assert_close(f"{name} out", out, want, atol=1e-5, rtol=1e-5)
                        assert_close(f"{name} lse", lse, want_lse, atol=1e-5, rtol=1e-5)
                        plain += 1
    assert plain


PACKED_RUNS = [(c, b) for c in PLAIN_CASES for b in ("torch", "triton")
               if b == "torch" or c == "causal"]


@pytest.mark.parametrize("case,backend", PACKED_RUNS, ids=["-".join(r) for r in PACKED_RUNS])
def test_packed_launches_equal_their_documents_plain_calls(case, backend):
    """A packed call (``_launches``: the plain calls of a step's documents joined, each
    document's pair one sequence of a varlen call) gives each row the output and LSE, and each
    row and key the gradient shares, of the documents' own calls one by one (``_pairs``), for
    every rank's ring steps and the all-gather's whole sequence (world sizes 2 and 4, zigzag
    and contiguous), and a step over many documents takes fewer launches than pairs."""
    from flashtile import distributed as cp_mod
    from flashtile.distributed import _Cfg, _attend, _attend_bwd, _empty_acc, _pairs, pieces
    c = PLAIN_CASES[case]
    lens = [3, 7, 1, 10, 5, 9, 2, 11]                      # 8 documents, 48 tokens
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    docs = [(d, a, b) for d, (a, b) in enumerate(zip(cu, cu[1:]))]
    S, H, Hk, D = cu[-1], 2, 1, 16
    window = c.get("window", (-1, -1))
    worlds = (2, 4) if backend == "torch" else (2,)
    joined = 0
    with flashtile.use_backend(backend), poison_outputs():
        for world, layout in ((w, lay) for w in worlds for lay in ("zigzag", "contiguous")):
            n = S // world
            cfg = _Cfg(world, 0, None, layout, "ring", c.get("causal", False), D ** -0.5, window,
                       c.get("softcap", 0.0), 0.0, None, None, docs, max(lens), varlen=True,
                       join=True)
            q, do = randn(1, n, H, D), randn(1, n, H, D)
            k_sets = [pieces(layout, world, src, n) for src in range(world)] + [[(0, 0, S)]]
            for rank in range(world):
                q_pieces = pieces(layout, world, rank, n)
                for k_pieces in k_sets:
                    nk = sum(p[2] for p in k_pieces)
                    k, v = randn(1, nk, Hk, D), randn(1, nk, Hk, D)
                    got, want = [], []
                    for runs in (got, want):
                        acc_o, acc_l = _empty_acc(q)
                        _attend(cfg, q, k, v, q_pieces, k_pieces, acc_o, acc_l, [])
                        # (the backward of the step's keys alone: its output and LSE)
                        out, lse = (got or [acc_o, acc_l])[:2]
                        grads = [torch.zeros(x.shape) for x in (q, k, v)]
                        _attend_bwd(cfg, do, q, k, v, out, lse, q_pieces, k_pieces, *grads)
                        runs.extend([acc_o, acc_l, *grads])
                        # the documents one by one: every call with no lengths
                        cfg.join = False
                    cfg.join = True
                    name = f"{case} w{world} {layout} rank {rank} keys {k_pieces}"
                    for what, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                        assert_close(f"{name} {what}", g, w, atol=1e-5, rtol=1e-5)
                    launches = cp_mod._launches(cfg, q_pieces, k_pieces)
                    assert sum(len(x[2][0]) if x[2] else 1 for x in launches) == \
                        len(_pairs(cfg, q_pieces, k_pieces)), name
                    joined += len(launches) < len(_pairs(cfg, q_pieces, k_pieces))
    assert joined


def test_varlen_documents_are_read_once_while_cu_seqlens_is_unchanged(monkeypatch):
    """The documents of a packed sequence come from one host read of ``cu_seqlens`` while the
    tensor is unchanged (a step's layers pass the same one); an in-place write reads it again,
    and its checks still run on what it holds then."""
    from flashtile import distributed as cp_mod
    reads = []
    real = cp_mod._read_docs
    monkeypatch.setattr(cp_mod, "_read_docs", lambda *a: reads.append(1) or real(*a))
    cu = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
    docs = ((0, 0, 5), (1, 5, 9), (2, 9, 16))
    assert cp_mod._docs(cu, 7, 16) == docs and cp_mod._docs(cu, 7, 16) == docs
    assert len(reads) == 1
    assert cp_mod._docs(cu.clone(), 7, 16) == docs and len(reads) == 2  # another tensor
    cu[1] = 3                                                          # an in-place write
    assert cp_mod._docs(cu, 7, 16) == ((0, 0, 3), (1, 3, 9), (2, 9, 16)) and len(reads) == 3
    cu[1] = 10
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        cp_mod._docs(cu, 7, 16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_in_place_merge_equals_merge_attention_states(dtype):
    """The ring's in-place float32 merge of a block (output in the inputs' dtype) against
    ``merge_attention_states`` on float32 copies, rows that saw no key on one side or on both
    (0 / -inf) included; a first block is copied."""
    from flashtile import merge_attention_states
    from flashtile.distributed import _merge
    B, S, H, D = 2, 7, 3, 8
    acc_o = randn(B, S, H, D)
    o = randn(B, S, H, D, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    acc_l, lse = randn(B, H, S), randn(B, H, S)
    acc_l[0, :, 1] = float("-inf")
    acc_o[0, 1] = 0.0
    lse[0, :, 2] = float("-inf")
    acc_l[1, :, 3] = lse[1, :, 3] = float("-inf")
    acc_o[1, 3] = 0.0
    want_o, want_l = merge_attention_states(acc_o, acc_l, o.float(), lse)
    got_o, got_l = acc_o.clone(), acc_l.clone()
    _merge(got_o, got_l, o, lse, first=False)
    assert_close("merged out", got_o, want_o, atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.isinf(got_l), torch.isinf(want_l))
    assert_close("merged lse", got_l, want_l, atol=1e-6, rtol=1e-6)
    assert torch.equal(got_o[1, 3], torch.zeros(H, D))
    first_o, first_l = torch.full_like(acc_o, float("nan")), torch.full_like(acc_l, float("nan"))
    _merge(first_o, first_l, o, lse, first=True)
    assert torch.equal(first_o, o.float()) and torch.equal(first_l, lse)


# ---------------------------------------------------------------------------------------
# context parallelism on gloo: one spawn per world size runs every case

COLLECTIVES = ("batch_isend_irecv", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast")


def _expected_collectives(mode: str, world: int, dropout: bool):
    """(forward, backward) counts per collective, as designed."""
    fwd = dict.fromkeys(COLLECTIVES, 0)
    bwd = dict.fromkeys(COLLECTIVES, 0)
    if mode == "ring":
        fwd["batch_isend_irecv"] = world - 1  # K/V hops
        bwd["batch_isend_irecv"] = (world - 1) + world  # K/V hops + dK/dV accumulator hops
    elif mode == "allgather":
        fwd["all_gather_into_tensor"] = 1
        bwd["all_gather_into_tensor"] = 1
        bwd["reduce_scatter_tensor"] = 1
    else:
        fwd["all_to_all_single"] = 2  # q/k/v in, output back
        bwd["all_to_all_single"] = 2  # dO in, dq/dk/dv back
    if dropout:
        fwd["broadcast"] = 1  # the seed
    return fwd, bwd


def _cases(world: int) -> dict:
    cases = {}
    for mode in ("ring", "allgather", "ulysses"):
        for layout in ("zigzag", "contiguous"):
            kinds = {"causal": dict(causal=True), "window": dict(window_size=(5, 2)),
                     "dropout": dict(causal=True, dropout_p=0.2),
                     "varlen-causal": dict(causal=True, varlen=True),
                     "varlen-dropout": dict(dropout_p=0.3, varlen=True)}
            if world > 2:  # the larger world: a subset
                kinds = {k: kinds[k] for k in ("dropout", "varlen-causal")}
            if mode == "ring" and layout == "zigzag":
                kinds["alibi-softcap"] = dict(causal=True, alibi=True, softcap=4.0)
                if world == 2:  # the Triton kernels (interpreted): documents' packed calls
                    kinds["varlen-causal-triton"] = dict(causal=True, varlen=True,
                                                         backend="triton")
            for kind, c in kinds.items():
                cases[f"w{world}-{mode}-{layout}-{kind}"] = dict(mode=mode, layout=layout, **c)
    return cases


def _reference(c, q, k, v, cu, keep, slopes, dtype):
    """Attention over the whole (packed) sequence in ``dtype`` (math_attention, per document
    for varlen)."""
    wl, wr = c.get("window_size", (-1, -1))
    kw = dict(window_left=wl, window_right=0 if c.get("causal") else wr,
              softcap=c.get("softcap", 0.0), dropout_p=c.get("dropout_p", 0.0))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if cu is None:
        return math_attention(q, k, v, alibi_slopes=slopes, dropout_mask=keep, **kw)[0]
    outs = []
    for d in range(len(cu) - 1):
        a, b = int(cu[d]), int(cu[d + 1])
        m = None if keep is None else keep[d:d + 1, :, :b - a, :b - a]
        outs.append(math_attention(q[None, a:b], k[None, a:b], v[None, a:b], dropout_mask=m,
                                   **kw)[0][0])
    return torch.cat(outs)


def _run_case(name, c, world, rank):
    import torch.distributed as dist

    from flashtile.distributed import (context_parallel_attn, context_parallel_varlen_attn,
                                       shard, unshard)
    from flashtile import distributed as cp_mod

    mode, layout, p = c["mode"], c["layout"], c.get("dropout_p", 0.0)
    H, Hk, D = (4, 2, 16) if world == 2 else (8, 4, 16)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    varlen = c.get("varlen", False)
    seq_dim = 0 if varlen else 1
    if varlen:
        S = 12 * world
        cu = torch.tensor([0, 5, 5 + 3 * world, S - 2, S], dtype=torch.int32)
        M = int((cu[1:] - cu[:-1]).max())
        shapes = [(S, h, D) for h in (H, Hk, Hk, H)]
    else:
        B, S, cu, M = 2, 8 * world, None, None
        shapes = [(B, S, h, D) for h in (H, Hk, Hk, H)]
    q, k, v, do = (torch.randn(*s, generator=gen) for s in shapes)
    slopes = torch.rand(H, generator=gen) * 0.5 if c.get("alibi") else None
    kw = dict(causal=c.get("causal", False), window_size=c.get("window_size", (-1, -1)),
              softcap=c.get("softcap", 0.0), alibi_slopes=slopes, dropout_p=p)

    # counted collectives and, for the ring, the order of posts and block computations
    counts, events = {}, []
    originals = {n: getattr(dist, n) for n in COLLECTIVES}

    def counting(n):
        def call(*a, **k):
            counts[n] = counts.get(n, 0) + 1
            events.append("post")
            return originals[n](*a, **k)
        return call

    orig_block, orig_partial = cp_mod._block_forward, cp_mod.partial_attention
    partial_calls = []

    packed_calls = []

    def block(*a, **k):
        events.append("compute")
        packed_calls.append(len(a) > 8 and a[8] is not None)  # (_launches' lens)
        return orig_block(*a, **k)

    def partial(*a, **k):
        partial_calls.append(1)
        return orig_partial(*a, **k)

    with flashtile.use_backend(c.get("backend", "torch")):
        torch.manual_seed(1234)
        seed = next_seed()
        if varlen:
            whole = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, M, M, **kw)
        else:
            whole = flashtile.flash_attn_func(q, k, v, **kw)
        local = [shard(x, layout=layout, seq_dim=seq_dim).requires_grad_() for x in (q, k, v)]
        torch.manual_seed(1234)
        for n in COLLECTIVES:
            setattr(dist, n, counting(n))
        cp_mod._block_forward, cp_mod.partial_attention = block, partial
        try:
            if varlen:
                out = context_parallel_varlen_attn(*local, cu, M, layout=layout, mode=mode, **kw)
            else:
                out = context_parallel_attn(*local, layout=layout, mode=mode, **kw)
            fwd_counts, fwd_events = dict(counts), list(events)
            counts.clear()
            out.backward(shard(do, layout=layout, seq_dim=seq_dim))
            bwd_counts = dict(counts)
        finally:
            for n, f in originals.items():
                setattr(dist, n, f)
            cp_mod._block_forward, cp_mod.partial_attention = orig_block, orig_partial
        got = [unshard(x, layout=layout, seq_dim=seq_dim)
               for x in (out.detach(), local[0].grad, local[1].grad, local[2].grad)]
    if rank:
        return
    want_fwd, want_bwd = _expected_collectives(mode, world, p > 0)
    assert {n: fwd_counts.get(n, 0) for n in COLLECTIVES} == want_fwd, \
        f"{name}: forward collectives {fwd_counts}, designed {want_fwd}"
    assert {n: bwd_counts.get(n, 0) for n in COLLECTIVES} == want_bwd, \
        f"{name}: backward collectives {bwd_counts}, designed {want_bwd}"
    # without dropout, ALiBi or a window every pair of pieces is a plain call (each is on a
    # causal diagonal or sees every key), which takes the sm_90 kernels on Hopper; dropout and
    # ALiBi need the global positions
    if c.get("window_size", (-1, -1)) == (-1, -1):
        needs_partial = p > 0 or slopes is not None
        assert bool(partial_calls) == needs_partial, \
            f"{name}: {len(partial_calls)} partial calls in the forward, expected " \
            f"{'some' if needs_partial else 'none'}"
    if mode == "ring" and layout == "zigzag" and not varlen and c.get("causal") and p == 0 \
            and slopes is None:
        # the rank's own K/V: the first piece's diagonal, and the second piece over both key
        # pieces as one bottom-right causal call; every other step one call (two query pieces
        # over one key piece, or one over both, joined)
        calls = fwd_events.count("compute")
        assert calls == 2 + world - 1, f"{name}: {calls} forward block calls"
    # the documents' plain calls of a step joined into packed calls on the Triton kernels only
    # (the torch engine runs PyTorch's fused CPU kernel for each)
    assert any(packed_calls) == (varlen and c.get("backend") == "triton"), \
        f"{name}: packed calls {packed_calls}"
    if mode == "ring":
        first = fwd_events[(1 if p > 0 else 0):]
        assert first[0] == "post" and "compute" in first[1:], \
            f"{name}: the first K/V hop must be posted before the first block is computed"
    # one flash_attn_func call on the whole sequence: the same function, the same dropout mask
    # (a key kept on one side and dropped on the other would move an output by ~0.1)
    assert_close(f"{name}: out vs flash_attn_func", got[0], whole, atol=1e-5, rtol=1e-5)
    if varlen:
        keep = keep_mask(seed, p, len(cu) - 1, H, M, M) if p else None
    else:
        keep = keep_mask(seed, p, q.shape[0], H, S, S) if p else None

    def ref_fn(q_, k_, v_, dtype):
        return _reference(c, q_, k_, v_, cu, keep, slopes, dtype)

    check_flash_rule(name, got[0], got[1:], [q, k, v], do, ref_fn, torch.float32)


def _finish(rank: int, results: dict, result_file: str) -> None:
    """Rank 0 writes the results; then every rank waits for the others, so that no rank tears
    its group down while a peer still exchanges with it (gloo then aborts the peer's process
    at exit, now and then)."""
    import torch.distributed as dist

    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(results, f)
    dist.barrier()


def _worker(rank, world, init_file, cases, result_file):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for name, c in cases.items():
            try:
                _run_case(name, c, world, rank)
                results[name] = "ok"
            except AssertionError as e:
                results[name] = str(e)
        _finish(rank, results, result_file)
    finally:
        dist.destroy_process_group()


_RESULTS: dict = {}


def _results(world: int) -> dict:
    if world not in _RESULTS:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            result_file = os.path.join(tmp, "results.json")
            mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), _cases(world), result_file),
                     nprocs=world, join=True)
            with open(result_file) as f:
                _RESULTS[world] = json.load(f)
    return _RESULTS[world]


@pytest.mark.parametrize("name", list(_cases(2)) + list(_cases(4)))
def test_context_parallel_matches_whole_sequence_call(name):
    world = int(name.split("-")[0][1:])
    result = _results(world)[name]
    assert result == "ok", result


def test_zigzag_shards_hold_chunks_r_and_2R_minus_1_minus_r():
    from flashtile.distributed import pieces

    R, n = 4, 6
    got = [pieces("zigzag", R, r, n) for r in range(R)]
    assert got[0] == [(0, 0, 3), (3, 21, 3)] and got[3] == [(0, 9, 3), (3, 12, 3)]
    starts = sorted(g for ps in got for _, g, _ in ps)
    assert starts == [3 * i for i in range(2 * R)]
    assert pieces("contiguous", R, 2, n) == [(0, 12, 6)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_partial_dropout_counters_of_a_batch_and_head_slice(backend):
    """Batch entry 1 and heads 4..5 of a (3, 8)-head call, keys split at 10: the keep mask is
    that slice of the whole call's (an element off would move the output far past the rule)."""
    S, D, p = 24, 16, 0.3
    q = randn(1, S, 2, D)
    k, v = randn(1, S, 1, D), randn(1, S, 1, D)
    seed = torch.tensor([next_seed()])
    keep = keep_mask(int(seed[0]), p, 3, 8, S, S)[1:2, 4:6]
    kw = dict(seqlen_q_total=S, seqlen_k_total=S, causal=True, dropout_p=p, rng_seed=seed,
              batch_offset=1, head_offset=4, nheads_total=8)
    with flashtile.use_backend(backend), poison_outputs():
        parts = [partial_attention(q, k[:, a:b], v[:, a:b], k_offset=a, **kw)
                 for a, b in ((0, 10), (10, S))]
    out, _ = flashtile.merge_attention_states(*parts[0], *parts[1])
    ref64 = math_attention(q.double(), k.double(), v.double(), window_right=0, dropout_mask=keep,
                           dropout_p=p)[0]
    base = math_attention(q, k, v, window_right=0, dropout_mask=keep, dropout_p=p)[0]
    assert_flash_rule(f"{backend} batch/head slice", out, ref64, base, 2, 1e-5)


def _compile_worker(rank, world, init_file, result_file):
    import datetime

    import torch.distributed as dist

    from flashtile.distributed import context_parallel_attn, context_parallel_varlen_attn, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    results = {}
    try:
        gen = torch.Generator().manual_seed(7)
        q, k, v, do = (torch.randn(1, 16 * world, h, 16, generator=gen) for h in (4, 2, 2, 4))
        cu = torch.tensor([0, 5, 11 * world, 16 * world], dtype=torch.int32)
        subgroup = dist.new_group(list(range(world)))  # a group of its own, passed by name
        with flashtile.use_backend("torch"):
            for mode in ("ring", "allgather", "ulysses", "ring-group"):
                for varlen in (False, True):
                    group = subgroup if mode == "ring-group" else None

                    def call(a, b, c):
                        kw = dict(causal=True, mode=mode.split("-")[0], group=group)
                        if varlen:
                            return context_parallel_varlen_attn(a, b, c, cu, 11 * world - 5, **kw)
                        return context_parallel_attn(a, b, c, **kw)
                    seq_dim = 0 if varlen else 1
                    xs = [x[0] if varlen else x for x in (q, k, v, do)]
                    local = [shard(x, seq_dim=seq_dim) for x in xs]
                    got = []
                    for fn in (call, torch.compile(call, fullgraph=True, dynamic=True)):
                        leaves = [x.clone().requires_grad_() for x in local[:3]]
                        out = fn(*leaves)
                        out.backward(local[3])
                        got.append([out.detach()] + [x.grad for x in leaves])
                    diff = max(float((a - b).abs().max()) for a, b in zip(*got))
                    results[f"{mode}{'-varlen' if varlen else ''}"] = diff
                    torch._dynamo.reset()
        _finish(rank, results, result_file)
    finally:
        dist.destroy_process_group()


def test_context_parallel_compiles_with_fullgraph_and_dynamic_shapes():
    """``torch.compile(fullgraph=True, dynamic=True)`` of every mode, dense and varlen, on two
    gloo ranks (the default group, and a group of its own for the ring): the forward and
    backward are one custom op each (no graph break), and the output and gradients equal the
    eager call's."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "results.json")
        mp.spawn(_compile_worker, args=(2, os.path.join(tmp, "init"), result_file), nprocs=2,
                 join=True)
        with open(result_file) as f:
            results = json.load(f)
    assert set(results) == {f"{m}{s}" for m in ("ring", "allgather", "ulysses", "ring-group")
                            for s in ("", "-varlen")}
    for name, diff in results.items():
        assert diff <= 1e-6, f"{name}: compiled vs eager differ by {diff}"
