"""Context-parallel attention benchmarks: the single-GPU check of the partial entry point and the
world-size-1 overhead (``check``), and weak / strong scaling over the ranks of one launch
(``scale``), with PyTorch's ``context_parallel`` (SDPA) as the peer in the same run.

    python -m flashtile.bench cp check                       # one GPU
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 8 -m flashtile.bench.cp scale   # one launch per world size

``scale`` measures one world size (the launch's): causal forward+backward, bf16, d=128, 16 heads
by default, every mode and layout, weak scaling (``--tokens-per-gpu`` x world) and strong
scaling (``--strong-seqlen``).  Efficiency is the attention TFLOP/s each GPU achieves inside the
distributed step (the whole sequence's FLOPs / world / step time) divided by the TFLOP/s of one
flashtile call on one GPU for the same total sequence, or for the longest one that fits (measured
in the same launch).  Results go to the device's results file (``benchmarks/results/<device>.json``)
under ``cp_check`` and ``cp_world<N>``, so launches for 1, 2, 4 and 8 GPUs fill one file.  NVLink multicast stays off in
every process (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).

``--device cpu`` runs the same code on gloo (a dry run at tiny sizes, torch backend).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import socket
import statistics
import sys
import time

# before torch.distributed / NCCL read them, in every process this module runs in
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from .common import results_path, runtime_env, write_result  # noqa: E402

MODES = ("ring", "allgather", "ulysses")
LAYOUTS = ("zigzag", "contiguous")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _seqlen(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad sequence length {text!r} (e.g. 4096, 32K, 1M)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashtile.bench.cp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("check", "scale", "report"),
                   help="check: one-GPU partial-entry check and world-1 overhead; scale: "
                   "scaling over this launch's ranks; report: the table and PNG of a results "
                   "file's cp_world<N> entries (--out, --png)")
    p.add_argument("--png", default=None, help="report: write the efficiency plot here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--tokens-per-gpu", type=_seqlen, default=32 * 1024,
                   help="weak scaling: sequence length per GPU (default 32K)")
    p.add_argument("--strong-seqlen", type=_seqlen, default=128 * 1024,
                   help="strong scaling: total sequence length (default 128K; 0 skips)")
    p.add_argument("--check-seqlen", type=_seqlen, default=4096,
                   help="correctness vs one device at this total length (default 4K)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--no-peer", action="store_true", help="skip PyTorch's context_parallel")
    p.add_argument("--longest", action="store_true",
                   help="also double the sequence (ring, zigzag) until a step fails to fit")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None,
                   help="results JSON; entries cp_check and cp_world<N> "
                        "(default: benchmarks/results/<device>.json)")
    return p


# ---------------------------------------------------------------------------------------
# setup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(device: str):
    """Process group of the launch (torchrun's environment), or of this process alone."""
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size()


def _dev(device: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else \
        torch.device("cpu")


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, warmup: int, iters: int) -> float:
    """Median seconds of ``fn()`` (the slowest rank's, when distributed)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64,
                     device=_dev(device) if device == "cuda" else "cpu")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def attn_flops(seqlen: int, heads: int, headdim: int, causal: bool = True,
               batch: int = 1) -> float:
    """Forward + backward FLOPs of attention (flash-attn's count: backward = 2.5 x forward)."""
    fwd = 4.0 * batch * heads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
    return 3.5 * fwd


def _inputs(S, a, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = DTYPES[a.dtype]
    return [torch.randn(1, S, a.heads, a.headdim, generator=g).to(device=device, dtype=dt)
            for _ in range(4)]


# ---------------------------------------------------------------------------------------
# steps


def _flashtile_step(q, k, v, do):
    from flashtile import flash_attn_func
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        out = flash_attn_func(q, k, v, causal=True)
        out.backward(do)
    return step


def _cp_step(q, k, v, do, mode, layout):
    from flashtile.distributed import context_parallel_attn
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def step():
        out = context_parallel_attn(q, k, v, causal=True, layout=layout, mode=mode)
        out.backward(do)
    return step


def _peer_time(S, a, device, world):
    """Seconds per causal fwd+bwd step of PyTorch's context_parallel over SDPA, and its K/V
    rotation method.  The ``(B, H, S, D)`` buffers are sharded in place (load-balanced) once,
    on entering the context; the steps run inside it on the local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental import _attention as cp_attention
    mesh = init_device_mesh(device, (world,))
    q, k, v, do = (x.transpose(1, 2).contiguous() for x in _inputs(S, a, device))
    with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers={q, k, v, do}):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def step():
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            out.backward(do)
        t = _time(step, device, a.warmup, a.iters)
    rotate = getattr(getattr(cp_attention, "_cp_options", None), "rotate_method", None)
    return t, str(getattr(rotate, "value", rotate))


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _single_device_tflops(S, a, device):
    """(seqlen measured, TFLOP/s) of one flashtile call on this device: ``S`` or the longest
    power-of-two fraction of it that fits."""
    while S >= 1024 or device == "cpu":
        try:
            q, k, v, do = _inputs(S, a, device)
            t = _time(_flashtile_step(q, k, v, do), device, a.warmup, a.iters)
            return S, attn_flops(S, a.heads, a.headdim) / t / 1e12
        except Exception as e:  # noqa: BLE001
            if not _oom(e) or device == "cpu":
                raise
            torch.cuda.empty_cache()
            S //= 2
    return S, float("nan")


# ---------------------------------------------------------------------------------------
# scale


def _measure_world(S, a, device, rank, world, ref, label):
    """Every mode and layout (and the peer) at total length ``S`` over the launch's ranks."""
    from flashtile.distributed import shard
    rows = []
    ref_len, ref_tflops = ref
    full = _inputs(S, a, device)
    for mode in a.modes:
        for layout in a.layouts:
            row = dict(scaling=label, world=world, seqlen=S, mode=mode, layout=layout,
                       impl="flashtile")
            try:
                if mode == "ulysses" and (a.heads % world):
                    raise ValueError(f"ulysses needs heads divisible by {world}")
                local = [shard(x, layout=layout) for x in full]
                t = _time(_cp_step(*local, mode, layout), device, a.warmup, a.iters)
                tflops = attn_flops(S, a.heads, a.headdim) / world / t / 1e12
                row.update(ms=t * 1e3, tflops_per_gpu=tflops, efficiency=tflops / ref_tflops,
                           reference_seqlen=ref_len, reference_tflops=ref_tflops)
            except Exception as e:  # noqa: BLE001
                row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if not a.no_peer:
        row = dict(scaling=label, world=world, seqlen=S, mode="context_parallel",
                   layout="torch", impl="torch.distributed.tensor.experimental.context_parallel"
                   " + SDPA")
        try:
            t, rotate = _peer_time(S, a, device, world)
            tflops = attn_flops(S, a.heads, a.headdim) / world / t / 1e12
            row.update(rotate_method=rotate, ms=t * 1e3, tflops_per_gpu=tflops, efficiency=tflops / ref_tflops,
                       reference_seqlen=ref_len, reference_tflops=ref_tflops)
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    return rows


def _flash_rule(q, k, v, do):
    """A function of ``[out, dq, dk, dv]`` (whole-sequence causal results) returning each one's
    error against float64 attention divided by PyTorch's error in the inputs' dtype
    (``flashtile.reference.torch_ref``): flash-attn's rule asks <= 2 for the output, <= 3 for
    the gradients."""
    from flashtile.backends.spec import AttnSpec
    from flashtile.reference.torch_ref import reference
    spec = AttnSpec(1.0 / math.sqrt(q.shape[-1]), -1, 0)
    refs = []
    for dt in (torch.float64, q.dtype):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        out = reference(*leaves, spec, dtype=dt)
        out.backward(do.to(dt))
        refs.append([out.detach()] + [x.grad for x in leaves])
        del out, leaves
    exact, low = refs
    base = [float((lo.double() - ex).abs().max()) for lo, ex in zip(low, exact)]
    del low

    def ratios(got):
        return {n: float((g.double() - ex).abs().max()) / b
                for n, g, ex, b in zip(("out", "dq", "dk", "dv"), got, exact, base)}
    return ratios


def _correctness(a, device, rank, world):
    """Outputs and gradients of every mode/layout against one device's whole-sequence call
    (max abs difference) and flash-attn's rule (error vs float64 over PyTorch's same-dtype
    error, as :func:`_flash_rule`; rank 0 computes it)."""
    from flashtile import flash_attn_func
    from flashtile.distributed import context_parallel_attn, shard, unshard
    S = a.check_seqlen
    q, k, v, do = _inputs(S, a, device, seed=1)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = flash_attn_func(*leaves, causal=True)
    out.backward(do)
    whole = [out.detach()] + [x.grad for x in leaves]
    rule = _flash_rule(q, k, v, do) if rank == 0 else None
    rows = [dict(world=world, seqlen=S, mode="one device", layout="",
                 flash_rule_ratio=rule(whole))] if rule else []
    for mode in a.modes:
        for layout in a.layouts:
            if mode == "ulysses" and a.heads % world:
                continue
            local = [shard(x, layout=layout).requires_grad_() for x in (q, k, v)]
            o = context_parallel_attn(*local, causal=True, layout=layout, mode=mode)
            o.backward(shard(do, layout=layout))
            got = [unshard(t, layout=layout) for t in [o.detach()] + [x.grad for x in local]]
            diffs = {n: float((g.float() - w.float()).abs().max())
                     for n, g, w in zip(("out", "dq", "dk", "dv"), got, whole)}
            row = dict(world=world, seqlen=S, mode=mode, layout=layout,
                       max_abs_diff_vs_one_device=diffs)
            if rule:
                row["flash_rule_ratio"] = rule(got)
            rows.append(row)
    if rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
    return rows


def _longest(a, device, rank, world):
    """The longest total sequence (doubling from tokens-per-gpu x world) whose ring/zigzag
    causal fwd+bwd step runs."""
    from flashtile.distributed import shard
    S, best = a.tokens_per_gpu * world, None
    while True:
        ok = torch.ones(1, device=_dev(device))
        try:
            local = [shard(x, layout="zigzag") for x in _inputs(S, a, device)]
            _cp_step(*local, "ring", "zigzag")()
            _sync(device)
        except Exception as e:  # noqa: BLE001
            if not _oom(e):
                raise
            ok.zero_()
        local = None
        if device == "cuda":
            torch.cuda.empty_cache()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not bool(ok[0]):
            break
        best, S = S, S * 2
    if rank == 0:
        print(json.dumps(dict(world=world, longest_seqlen_trained=best)), flush=True)
    return best


def _scale(a, rank, world, device):
    results = dict(runtime_env(device), world=world, gpus_visible=(
                       torch.cuda.device_count() if device == "cuda" else 0),
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   dtype=a.dtype, heads=a.heads, headdim=a.headdim, causal=True, batch=1,
                   tokens_per_gpu=a.tokens_per_gpu, strong_seqlen=a.strong_seqlen, rows=[])
    results["correctness"] = _correctness(a, device, rank, world)
    weak = a.tokens_per_gpu * world
    ref = _single_device_tflops(weak, a, device)
    if rank == 0:
        print(json.dumps(dict(reference="flashtile, one device", seqlen=ref[0],
                              tflops=ref[1])), flush=True)
    results["reference"] = {"weak": dict(seqlen=ref[0], tflops=ref[1])}
    results["rows"] += _measure_world(weak, a, device, rank, world, ref, "weak")
    if a.strong_seqlen:
        sref = _single_device_tflops(a.strong_seqlen, a, device)
        results["reference"]["strong"] = dict(seqlen=sref[0], tflops=sref[1])
        results["rows"] += _measure_world(a.strong_seqlen, a, device, rank, world, sref,
                                          "strong")
    if a.longest:
        results["longest_seqlen_trained"] = _longest(a, device, rank, world)
    return results


# ---------------------------------------------------------------------------------------
# check (one device)


def _check(a, device):
    """Partial entry point at several offsets vs slices of the whole call (bf16 inputs), and
    the ring / allgather / ulysses paths at world size 1 vs a plain call."""
    from flashtile import flash_attn_func, merge_attention_states
    from flashtile.distributed import partial_attention, partial_attention_backward
    from flashtile.rng import draw_seed
    S = a.check_seqlen
    q, k, v, do = _inputs(S, a, device, seed=2)
    out = {"partial": [], "world1_overhead": []}
    # world size 1 first (timings on a quiet device): the distributed paths around one device
    # vs the plain call
    for S1 in sorted({a.check_seqlen, a.tokens_per_gpu}):
        q1, k1, v1, do1 = _inputs(S1, a, device)
        base = _time(_flashtile_step(q1, k1, v1, do1), device, a.warmup, a.iters)
        for mode in a.modes:
            for layout in a.layouts:
                t = _time(_cp_step(q1, k1, v1, do1, mode, layout), device, a.warmup, a.iters)
                row = dict(seqlen=S1, mode=mode, layout=layout, plain_ms=base * 1e3,
                           cp_ms=t * 1e3, overhead=t / base - 1.0)
                out["world1_overhead"].append(row)
                print(json.dumps(row), flush=True)
    # the partial entry point at offsets that are not tile multiples, dropout first
    for causal, window, p in ((True, (-1, -1), 0.1), (True, (-1, -1), 0.0),
                              (False, (300, 100), 0.0)):
        torch.manual_seed(3)
        seed = draw_seed(q.device)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        torch.manual_seed(3)
        whole = flash_attn_func(*leaves, causal=causal, window_size=window, dropout_p=p)
        whole.backward(do)
        cuts = [0, 1, S // 3, S // 2 + 17, S]  # offsets that are not tile multiples too
        for q0, q1 in ((0, S // 2 + 17), (S // 2 + 17, S)):
            merged = None
            grads = []
            for k0, k1 in zip(cuts, cuts[1:]):
                kw = dict(q_offset=q0, k_offset=k0, seqlen_q_total=S, seqlen_k_total=S,
                          causal=causal, window_size=window, dropout_p=p,
                          rng_seed=seed if p else None)
                o, lse = partial_attention(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], **kw)
                merged = (o, lse) if merged is None else merge_attention_states(
                    merged[0], merged[1], o, lse)
                grads.append((k0, k1, kw))
            dq = torch.zeros(q[:, q0:q1].shape, dtype=torch.float32, device=q.device)
            for k0, k1, kw in grads:
                g = partial_attention_backward(do[:, q0:q1], q[:, q0:q1], k[:, k0:k1],
                                               v[:, k0:k1], whole[:, q0:q1].detach(),
                                               merged[1], **kw)
                dq += g[0]
            row = dict(causal=causal, window=list(window), dropout_p=p, rows=[q0, q1],
                       key_cuts=cuts,
                       out_max_abs_diff=float((merged[0] - whole[:, q0:q1].detach().float()).abs().max()),
                       dq_max_abs_diff=float((dq - leaves[0].grad[:, q0:q1].float()).abs().max()),
                       bf16_ulp_of_max_out=float(whole.detach().float().abs().max()) * 2.0 ** -8)
            out["partial"].append(row)
            print(json.dumps(row), flush=True)
    return out


def scaling_rows(results: dict) -> list[dict]:
    """The timed rows of every ``cp_world<N>`` entry of a results file, by world size."""
    rows = []
    for key in sorted(k for k in results if re.fullmatch(r"cp_world\d+", k)):
        rows += [r for r in results[key]["rows"] if "efficiency" in r]
    return sorted(rows, key=lambda r: (r["scaling"], r["world"]))


def report(results: dict, png: str | None = None) -> str:
    """A markdown table of the scaling rows (efficiency per mode and layout, and the peer's),
    and with ``png`` a bar chart of the same."""
    rows = scaling_rows(results)
    cols = sorted({(r["mode"], r["layout"]) for r in rows},
                  key=lambda c: (c[0] == "context_parallel", c))
    def tokens(n):
        return f"{n // 1024}K" if n % 1024 == 0 else str(n)
    groups = sorted({(r["scaling"], r["world"], r["seqlen"]) for r in rows},
                    key=lambda g: (g[0] != "weak", g[1]))
    eff = {(r["scaling"], r["world"], r["mode"], r["layout"]): r["efficiency"] for r in rows}
    names = [f"{m} {lay}" if m != "context_parallel" else "torch context_parallel"
             for m, lay in cols]
    lines = ["| scaling | GPUs | sequence | " + " | ".join(names) + " |",
             "|---" * (3 + len(cols)) + "|"]
    for sc, w, n in groups:
        cells = [f"{eff[(sc, w, m, lay)]:.2f}" if (sc, w, m, lay) in eff else ""
                 for m, lay in cols]
        lines.append(f"| {sc} | {w} | {tokens(n)} | " + " | ".join(cells) + " |")
    if png and rows:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(11, 4.2))
        width = 0.8 / len(cols)
        for i, ((m, lay), name) in enumerate(zip(cols, names)):
            ax.bar([g + i * width for g in range(len(groups))],
                   [eff.get((sc, w, m, lay), 0.0) for sc, w, _ in groups], width, label=name,
                   hatch="//" if m == "context_parallel" else None)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{sc}\n{w} GPUs, {tokens(n)}" for sc, w, n in groups])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("efficiency (TFLOP/s per GPU / one GPU's)")
        ax.set_ylim(0, 1.3)
        first = results[next(k for k in results if k.startswith("cp_world"))]
        ax.set_title(f"Context-parallel causal fwd+bwd, {first['dtype']}, {first['heads']} heads,"
                     f" d={first['headdim']} ({first['device']}, {first['date'][:10]})")
        ax.legend(ncol=4, fontsize=8, loc="upper center")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
    return "\n".join(lines)


def _write(path, key, value):
    write_result(path, key, value)
    print(f"wrote {path} [{key}]", flush=True)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    a.layouts = [m for m in a.layouts.split(",") if m]
    bad = [m for m in a.modes if m not in MODES] + [x for x in a.layouts if x not in LAYOUTS]
    if bad:
        raise SystemExit(f"unknown mode/layout: {bad}")
    if a.what == "report":
        with open(results_path(a.device, a.out)) as f:
            print(report(json.load(f), a.png))
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU; use --device cpu for a dry run")
    import flashtile
    rank, world = _init(a.device)
    # on the CPU the tiled torch engine (the Triton interpreter would take hours)
    backend = flashtile.use_backend("torch") if a.device == "cpu" else contextlib.nullcontext()
    try:
        with backend:
            out = results_path(a.device, a.out)
            if a.what == "check":
                if world != 1:
                    raise SystemExit("check runs on one device (no torchrun)")
                _write(out, "cp_check", _check(a, a.device))
            else:
                result = _scale(a, rank, world, a.device)
                if rank == 0:
                    _write(out, f"cp_world{world}", result)
        # every rank's last exchange done before any rank tears its group down (gloo aborts
        # a process whose peer closed the connection under it)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
