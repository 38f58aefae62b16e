"""Decode-step benchmark: flash_attn_with_kvcache vs SDPA and FlexAttention on one CUDA GPU.

Shapes: one new query token per sequence, ``nheads`` query heads over ``nheads_k`` KV heads
(GQA), head dim 128, bf16, cache lengths 4K..128K, batch 1 / 8 / 64 (all configurable).

For every (batch, cache_len) it times the median of many calls, L2 emptied before each one
(``--l2-flush read``, the default: a 256 MB buffer is read, leaving L2 cold and clean; ``write``:
``triton.testing.do_bench``'s memset, which leaves ~50 MB of dirty lines whose write-back the
timed call pays for, ~17 us on an H100, a third of a batch-1 16K decode step):

  flashtile             eager call, full cache (cache_seqlens = cache_len), contiguous cache
  flashtile_cudagraph   the same call captured in a CUDA graph and replayed
  flashtile_paged_cudagraph   paged cache (--page-size, pages in random order), graph replay
  flashtile_step_cudagraph    a whole decode step: append 1 new k/v token with rotary at
                              position cache_len - 1, then attend (graph replay)
  sdpa_default          torch SDPA with no backend forced (PyTorch's own choice), enable_gqa=True
  sdpa_<backend>        torch SDPA restricted to cudnn / flash / efficient / math with
                        enable_gqa=True (graph replay when capturable, else eager); when a
                        backend rejects GQA and memory allows, K/V repeated per query head
                        beforehand (impl suffix ``_repeat_kv``, repeat not timed)
  flex                  torch.compile(flex_attention, enable_gqa=True)
  read_same_bytes       a Triton reduction (8 KB per program, graph replay) reading as many
                        bytes as the K/V cache: what one kernel that only reads reaches at this
                        size (the best of the grids and tiles tried; torch.sum reaches less)

A model's decode step runs one such call per layer, back to back in one CUDA graph, so the
fixed cost of one replay (~3.5 us between the events on an H100, for a graph of one empty
kernel) is paid once per step, not per layer.  Unless ``--layers 0``, each configuration is
also timed that way: ``L`` layers (``--layers``, fewer when ``L`` caches would pass
``--layers-gb``), each with its own q and K/V cache, in one graph; ``ms`` is per layer:

  flashtile_layers, sdpa_cudnn_layers, sdpa_default_layers, read_same_bytes_layers (one read
  of each layer's K/V)

Achieved bandwidth counts the bytes a decode step must move: the K and V cache read once plus q
read and out written; ``frac_of_copy_bw`` divides it by the bandwidth of a large device-to-device
``copy_`` measured at start (bytes read + written / time).

Correctness (contiguous, paged and append+rotary steps against the oracle, graph replays against
eager calls) is checked by ``tests/gpu/test_decode_graphs.py``.  The records
``{impl, batch, cache_len, ms, GBps, frac_of_copy_bw, device, torch, triton, date, ...}`` go to
entry ``decode`` of the device's results file (``benchmarks/results/<device>.json``, ``--out``;
a record replaces an older one of the same case, see :func:`record_key`), and a table is printed.

    python -m flashtile.bench decode                       # batch 1/8/64, cache 4K..128K
    python -m flashtile.bench decode --out /tmp/quick.json --quick
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import sys
import traceback

import torch

import triton
import triton.language as tl
from triton.testing import do_bench

from flashtile.backends.triton import launch_decode
from flashtile import flash_attn_with_kvcache
from flashtile.bench.common import merge_result, results_path

KEY = "decode"  # the entry of the results file that holds the decode records


def record_key(rec: dict) -> tuple:
    """What makes two decode records the same measurement (a new record replaces an old one
    with the same key in the results file)."""
    return tuple(rec.get(k) for k in ("device", "impl", "batch", "cache_len", "mode",
                                      "num_splits", "layers", "page_size", "dtype", "nheads",
                                      "nheads_k", "headdim", "l2_flush"))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
# How the L2 cache is emptied before each timed call: "write" is do_bench's (a 256 MB memset,
# which leaves ~50 MB of dirty lines that the timed kernel then waits on while they are written
# back), "read" reads a 256 MB buffer instead, so the timed call starts from a cold and clean L2.
L2_FLUSH = "read"
_FLUSH_BYTES = 256 << 20


@functools.lru_cache(maxsize=1)
def _flush_buffers() -> tuple[torch.Tensor, torch.Tensor]:
    """The 256 MB buffer read to empty L2, and the scalar its sum goes to (made once)."""
    buf = torch.empty(_FLUSH_BYTES // 4, dtype=torch.float32, device=DEVICE).normal_()
    return buf, torch.empty((), dtype=torch.float32, device=DEVICE)


def bench_ms(fn, warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn`` with L2 emptied before every call (see ``L2_FLUSH``)."""
    if L2_FLUSH == "write":
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    buf, sink = _flush_buffers()

    def flush():
        torch.sum(buf, 0, out=sink)

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    n_warmup, n_rep = max(1, int(warmup / estimate)), max(1, int(rep / estimate))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return float(times[len(times) // 2])


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[p] = sum(x[p * BLOCK : (p + 1) * BLOCK])``: a plain read of ``x``, one tile each."""
    i_p = tl.program_id(0)
    o = i_p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    b_x = tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)  # [BLOCK]
    tl.store(out_ptr + i_p, tl.sum(b_x, 0))


def plain_read(x: torch.Tensor):
    """A function that reads every byte of ``x`` once (8 KB of 16-bit values per program)."""
    flat = x.reshape(-1)
    block = 8192 // flat.element_size()
    grid = triton.cdiv(flat.numel(), block)
    out = torch.empty(grid, device=x.device, dtype=torch.float32)
    return lambda: _read_kernel[(grid,)](flat, out, flat.numel(), BLOCK=block, num_warps=4)


def capture(fn, warmup_calls: int = 3):
    """Capture ``fn()`` in a CUDA graph after warming it up on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    torch.cuda.synchronize()
    return graph, result



def graph_ms(fn, warmup: int = 10, rep: int = 60) -> float:
    """Median ms of ``fn`` captured in a CUDA graph and replayed (L2 emptied before each)."""
    graph, _ = capture(fn)
    ms = bench_ms(graph.replay, warmup, rep)
    del graph
    return ms


def graph_or_eager_ms(fn, args):
    """Median ms of ``fn`` replayed from a CUDA graph, or called eagerly where capture fails."""
    try:
        return graph_ms(fn, args.warmup, args.rep), "graph"
    except Exception:
        torch.cuda.synchronize()
        return bench_ms(fn, args.warmup, args.rep), "eager"

def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


def cleanup() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def copy_bandwidth(warmup: int, rep: int) -> float:
    """GB/s of a device-to-device copy of 1 GiB (bytes read + bytes written)."""
    n = 1 << 29
    x = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), warmup, rep)
    del x, y
    cleanup()
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def rotary_tables(n_pos: int, rotary_dim: int, device):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim))
    ang = torch.arange(n_pos, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


# --------------------------------------------------------------------------------------------
# one configuration
# --------------------------------------------------------------------------------------------
def run_config(args, dtype, batch, cache_len, copy_bw, meta) -> list[dict]:
    h, hk, d = args.nheads, args.nheads_k, args.headdim
    g = h // hk
    elt = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * batch * cache_len * hk * d * elt
    io_bytes = kv_bytes + 2 * batch * h * d * elt
    records = []

    def record(impl, ms, mode, **extra):
        r = dict(impl=impl, batch=batch, cache_len=cache_len, ms=ms, mode=mode,
                 GBps=(io_bytes / (ms * 1e-3) / 1e9) if ms else None,
                 frac_of_copy_bw=((io_bytes / (ms * 1e-3) / 1e9) / copy_bw) if ms else None,
                 nheads=h, nheads_k=hk, headdim=d, dtype=str(dtype).replace("torch.", ""), **meta)
        r.update(extra)
        records.append(r)
        if ms:
            log(f"  {impl:<34} {mode:<6} {ms:9.4f} ms  {r['GBps']:8.1f} GB/s  {100 * r['frac_of_copy_bw']:5.1f}% of copy")
        else:
            log(f"  {impl:<34} skipped: {extra.get('status')}")

    if kv_bytes > 0.85 * free_bytes():
        record("flashtile", None, "-", status=f"K/V cache of {kv_bytes / 1e9:.1f} GB does not fit")
        return records

    dev = DEVICE
    q = torch.empty(batch, 1, h, d, device=dev, dtype=dtype).normal_()
    kc = torch.empty(batch, cache_len, hk, d, device=dev, dtype=dtype).normal_()
    vc = torch.empty(batch, cache_len, hk, d, device=dev, dtype=dtype).normal_()
    lens = torch.full((batch,), cache_len, dtype=torch.int32, device=dev)
    splits = launch_decode.default_num_splits(q, hk, cache_len)

    def ours():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)

    if kv_bytes <= (1 << 30):
        # the floor at this size: one kernel reading as many bytes as the K/V cache
        src = torch.empty(kv_bytes // 2, device=dev, dtype=torch.bfloat16).normal_()
        try:
            record("read_same_bytes", graph_ms(plain_read(src), args.warmup, args.rep), "graph",
                   status="ok")
        finally:
            del src

    ref_out = None
    try:
        ref_out = ours()
        record("flashtile", bench_ms(ours, args.warmup, args.rep), "eager", num_splits=splits, status="ok")
        record("flashtile_cudagraph", graph_ms(ours, args.warmup, args.rep), "graph",
               num_splits=splits, status="ok")
        for s in args.sweep_splits:
            def ours_s(s=s):
                return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=s)
            record(f"flashtile_splits{s}_cudagraph", graph_ms(ours_s, args.warmup, args.rep), "graph",
                   num_splits=s, status="ok")
    except Exception as exc:  # keep going: record what failed
        record("flashtile", None, "-", status=f"error: {type(exc).__name__}: {exc}")
        traceback.print_exc()

    # paged: the same memory viewed as pages of --page-size, visited in random order
    try:
        page = args.page_size
        if cache_len % page == 0:
            per = cache_len // page
            kp = kc.view(batch * per, page, hk, d)
            vp = vc.view(batch * per, page, hk, d)
            table = torch.randperm(batch * per, device=dev).reshape(batch, per).to(torch.int32)

            def ours_paged():
                return flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)

            record("flashtile_paged_cudagraph", graph_ms(ours_paged, args.warmup, args.rep), "graph",
                   num_splits=launch_decode.default_num_splits(q, hk, cache_len, page_size=page),
                   page_size=page, status="ok")
            del table
    except Exception as exc:
        record("flashtile_paged_cudagraph", None, "-", status=f"error: {type(exc).__name__}: {exc}")
        traceback.print_exc()

    # a full decode step: append one token (with rotary) at cache_len - 1, then attend
    try:
        cos, sin = rotary_tables(cache_len, d, dev)
        k_new = torch.empty(batch, 1, hk, d, device=dev, dtype=dtype).normal_()
        v_new = torch.empty_like(k_new).normal_()
        lens_step = lens - 1

        def ours_step():
            return flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=lens_step, causal=True)

        record("flashtile_step_cudagraph", graph_ms(ours_step, args.warmup, args.rep), "graph",
               num_splits=splits, status="ok")
    except Exception as exc:
        record("flashtile_step_cudagraph", None, "-", status=f"error: {type(exc).__name__}: {exc}")
        traceback.print_exc()

    # the step above rewrote cache slot cache_len - 1: recompute what the baselines must match
    try:
        ref_out = ours()
    except Exception:
        ref_out = None

    # baselines in the (B, H, S, D) layout: transposed views, no copies
    from torch.nn.attention import SDPBackend
    import torch.nn.functional as F

    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def check_err(out_bhsd):
        if ref_out is None:
            return None
        return (out_bhsd.transpose(1, 2).float() - ref_out.float()).abs().max().item()

    for name in args.sdpa:
        # "default": no backend forced, PyTorch's own choice
        backend = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
        impl = f"sdpa_{name}"
        fn = None
        try:
            def fn_gqa(backend=backend):
                with _forced(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            fn_gqa()
            fn = fn_gqa
        except Exception as exc:
            gqa_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if 2 * kv_bytes * g * 1.1 < 0.85 * free_bytes():
                kr = kt.repeat_interleave(g, dim=1)
                vr = vt.repeat_interleave(g, dim=1)

                def fn_rep(backend=backend, kr=kr, vr=vr):
                    with _forced(backend):
                        return F.scaled_dot_product_attention(qt, kr, vr)
                try:
                    fn_rep()
                    fn = fn_rep
                    impl += "_repeat_kv"
                except Exception as exc2:
                    record(impl, None, "-", status=f"enable_gqa: {gqa_error}; repeat_kv: "
                           f"{type(exc2).__name__}: {str(exc2).splitlines()[0][:200]}")
            else:
                record(impl, None, "-", status=f"enable_gqa: {gqa_error}; repeat_kv needs "
                       f"{2 * kv_bytes * g / 1e9:.1f} GB")
        if fn is None:
            cleanup()
            continue
        try:
            err = check_err(fn())
            ms, mode = graph_or_eager_ms(fn, args)
            record(impl, ms, mode, max_abs_err_vs_flashtile=err, status="ok")
        except Exception as exc:
            record(impl, None, "-", status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        fn = None
        cleanup()

    if args.flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = _compiled_flex(flex_attention)

            def fn_flex():
                return compiled(qt, kt, vt, enable_gqa=True)

            err = check_err(fn_flex())
            ms, mode = graph_or_eager_ms(fn_flex, args)
            record("flex", ms, mode, max_abs_err_vs_flashtile=err, status="ok")
        except Exception as exc:
            record("flex", None, "-", status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            traceback.print_exc()

    del q, kc, vc, qt, kt, vt, ref_out
    cleanup()
    return records


def run_layers(args, dtype, batch, cache_len, copy_bw, meta) -> list[dict]:
    """Per-layer time of ``L`` decode calls, each on its own cache, in one CUDA graph."""
    h, hk, d = args.nheads, args.nheads_k, args.headdim
    elt = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = 2 * batch * cache_len * hk * d * elt
    io_bytes = kv_bytes + 2 * batch * h * d * elt
    n_layers = min(args.layers, int(min(args.layers_gb * 1e9, 0.7 * free_bytes()) // kv_bytes))
    records = []
    if n_layers < 2:
        return records
    dev = DEVICE
    qs = [torch.empty(batch, 1, h, d, device=dev, dtype=dtype).normal_() for _ in range(n_layers)]
    # K and V of a layer in one allocation, so that the floor reads them with one kernel
    kvs = [torch.empty(2, batch, cache_len, hk, d, device=dev, dtype=dtype).normal_() for _ in range(n_layers)]
    lens = torch.full((batch,), cache_len, dtype=torch.int32, device=dev)

    def ours():
        return [flash_attn_with_kvcache(q, kv[0], kv[1], cache_seqlens=lens) for q, kv in zip(qs, kvs)]

    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return [F.scaled_dot_product_attention(q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                                                   enable_gqa=True) for q, kv in zip(qs, kvs)]

    def sdpa_default():
        return [F.scaled_dot_product_attention(q.transpose(1, 2), kv[0].transpose(1, 2),
                                               kv[1].transpose(1, 2), enable_gqa=True)
                for q, kv in zip(qs, kvs)]

    reads = [plain_read(kv) for kv in kvs]
    for impl, fn in (("read_same_bytes_layers", lambda: [r() for r in reads]),
                     ("flashtile_layers", ours), ("sdpa_cudnn_layers", cudnn),
                     ("sdpa_default_layers", sdpa_default)):
        r = dict(impl=impl, batch=batch, cache_len=cache_len, layers=n_layers, nheads=h, nheads_k=hk,
                 headdim=d, dtype=str(dtype).replace("torch.", ""), **meta)
        try:
            ms = graph_ms(fn, args.warmup, args.rep) / n_layers
            gbps = io_bytes / (ms * 1e-3) / 1e9
            r.update(ms=ms, mode="graph", GBps=gbps, frac_of_copy_bw=gbps / copy_bw, status="ok")
            log(f"  {impl:<34} graph  {ms:9.4f} ms  {gbps:8.1f} GB/s  {100 * gbps / copy_bw:5.1f}% of copy"
                f"  (per layer, {n_layers} layers)")
        except Exception as exc:
            r.update(ms=None, mode="-", status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            log(f"  {impl:<34} skipped: {r['status']}")
        records.append(r)
    del qs, kvs, reads
    cleanup()
    return records


def _forced(backend):
    """``sdpa_kernel([backend])``, or no restriction when ``backend`` is None."""
    from torch.nn.attention import sdpa_kernel

    return contextlib.nullcontext() if backend is None else sdpa_kernel([backend])


_FLEX = {}


def _compiled_flex(flex_attention):
    if "fn" not in _FLEX:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 256)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


# --------------------------------------------------------------------------------------------
def print_table(records) -> None:
    rows = [r for r in records if r.get("batch") is not None]
    log("")
    log(f"{'impl':<36} {'batch':>5} {'cache':>7} {'mode':<6} {'ms':>9} {'GB/s':>8} {'%copy':>6}  status")
    for r in rows:
        if r.get("ms"):
            log(f"{r['impl']:<36} {r['batch']:>5} {r['cache_len']:>7} {r['mode']:<6} {r['ms']:>9.4f} "
                f"{r['GBps']:>8.1f} {100 * r['frac_of_copy_bw']:>6.1f}  ok")
        else:
            log(f"{r['impl']:<36} {r['batch']:>5} {r['cache_len']:>7} {'-':<6} {'-':>9} {'-':>8} {'-':>6}  "
                f"{r.get('status')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashtile.bench decode",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, metavar="FILE",
                   help="results JSON; the records are merged into its 'decode' entry, a record "
                        "replacing an older one of the same case "
                        "(default: benchmarks/results/<device>.json)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--cache-lens", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    p.add_argument("--nheads", type=int, default=32)
    p.add_argument("--nheads-k", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--sdpa", nargs="*", default=["default", "cudnn", "flash", "efficient", "math"],
                   choices=["default", "cudnn", "flash", "efficient", "math"],
                   help="SDPA peers: 'default' forces no backend (PyTorch's own choice), the "
                        "others force one backend each (default: all)")
    p.add_argument("--no-flex", dest="flex", action="store_false")
    p.add_argument("--sweep-splits", type=int, nargs="*", default=[],
                   help="also time flashtile with these explicit num_splits")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up time (ms)")
    p.add_argument("--rep", type=int, default=50, help="do_bench measuring time (ms)")
    p.add_argument("--l2-flush", choices=["read", "write"], default="read",
                   help="empty L2 before each timed call by reading a 256 MB buffer (default) or, "
                   "as triton.testing.do_bench does, by a memset whose dirty lines the timed call "
                   "then waits on")
    p.add_argument("--layers", type=int, default=32,
                   help="also time L decode calls on L caches in one graph, per layer (0: off)")
    p.add_argument("--layers-gb", type=float, default=8.0,
                   help="at most this many GB of K/V caches for the layered timing")
    p.add_argument("--quick", action="store_true", help="batches 1 8, cache 4K 16K, no flex")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.cache_lens, args.flex = [1, 8], [4096, 16384], False
    if not torch.cuda.is_available():
        log("python -m flashtile.bench decode needs a CUDA GPU")
        return 2
    dtype = DTYPES[args.dtype]
    out = results_path("cuda", args.out)
    global L2_FLUSH
    L2_FLUSH = args.l2_flush
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                l2_flush=args.l2_flush)
    log(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  "
        f"SMs {launch_decode.num_sms(torch.device('cuda'))}")
    records = []
    copy_bw = copy_bandwidth(args.warmup, args.rep)
    log(f"device copy bandwidth: {copy_bw:.1f} GB/s (read + write)")
    records.append(dict(impl="device_copy", batch=None, cache_len=None, ms=None, GBps=copy_bw,
                        frac_of_copy_bw=1.0, **meta))
    try:
        for batch in args.batches:
            for cache_len in args.cache_lens:
                log(f"batch {batch}, cache {cache_len}, heads {args.nheads}/{args.nheads_k}, d {args.headdim}")
                records.extend(run_config(args, dtype, batch, cache_len, copy_bw, meta))
                if args.layers > 0:
                    records.extend(run_layers(args, dtype, batch, cache_len, copy_bw, meta))
                merge_result(out, KEY, records, record_key)
    finally:
        merge_result(out, KEY, records, record_key)
    print_table(records)
    log(f"wrote {len(records)} records to {out} [{KEY}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
