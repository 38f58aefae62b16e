"""Speed benchmark (``python -m flashtile.bench [speed] ...``): TFLOP/s of flashtile against
PyTorch's attention kernels (SDPA with no backend forced, FlashAttention-2, cuDNN, efficient,
math) and FlexAttention, all in one process on the same inputs.

    python -m flashtile.bench --quick                      # small preset, a minute or two on a GPU
    python -m flashtile.bench --mode fwd_bwd --d 128 --n 8K

The records go to the device's results file (``benchmarks/results/<device>.json``, entry
``speed``; the copy and matmul ceilings to entry ``device``), the table to stdout and the plots to
``--plots``.

``python -m flashtile.bench overhead`` (:func:`overhead_main`) measures the host side instead:
microseconds per call on an input too small for the GPU work to count, with direct launches and
launch plans off and on, and the short-sequence forwards where that host time shows.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


from . import common
from .common import (DTYPES, IMPLS, MODES, Case, classify_error, common_arguments,
                     default_device, empty_cache, first_line, flatten, is_fatal, load_records,
                     log, make_progress, make_record, make_timer, parse_dtype, parse_names,
                     parse_seqlen, positive_int, record_key, reset_flex_cache, run_case,
                     merge_result, results_path, runtime_env, case_fields, synchronize, utc_now,
                     write_result)
from .report import plot, render_table

KEY = "speed"  # the entry of the results file that holds the speed records
DEVICE_KEY = "device"  # ... and the one with the device ceilings

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Preset:
    """What a sweep runs: implementations, modes, causal values, dtypes, head dims, sequence
    lengths, the batch/heads rule (``batch = tokens // N``, ``heads = hidden // d``) and the
    timer's warm-up and measuring time in ms."""

    impls: tuple[str, ...]
    modes: tuple[str, ...]
    causal: tuple[bool, ...]
    dtypes: tuple[str, ...]
    ds: tuple[int, ...]
    ns: tuple[int, ...]
    tokens: int
    hidden: int
    warmup: float
    rep: float


# "sdpa_default" is PyTorch's own choice (cuDNN on an H100 with torch 2.11): the peer an
# H100 user compares with; the others force one SDPA backend each.
GPU_IMPLS = ("flashtile", "sdpa_default", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
             "sdpa_math", "flex")
CPU_IMPLS = ("flashtile", "sdpa", "sdpa_math")
ALL_MODES = ("fwd", "bwd", "fwd_bwd")

PRESETS: dict[tuple[str, bool], Preset] = {
    # the FlashAttention papers' sweep: 16K tokens per batch, hidden 2048
    ("cuda", False): Preset(GPU_IMPLS, ALL_MODES, (False, True), ("bf16", "fp16"), (64, 128, 256),
                            (512, 1024, 2048, 4096, 8192, 16384), 16384, 2048, 25, 100),
    ("cuda", True): Preset(GPU_IMPLS, ALL_MODES, (False, True), ("bf16",), (128,),
                           (1024, 4096), 16384, 2048, 10, 40),
    ("cpu", False): Preset(CPU_IMPLS, ALL_MODES, (False, True), ("fp32", "bf16"), (64,),
                           (256, 512, 1024, 2048), 2048, 128, 0, 20),
    ("cpu", True): Preset(CPU_IMPLS, ALL_MODES, (False, True), ("fp32",), (64,),
                          (256, 512), 1024, 128, 0, 5),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """A speed run: the ``Preset`` it sweeps (defaults overridden by flags) and how it runs."""

    device: str
    preset: Preset
    out: Path | None = None  # results file; None: the device's, benchmarks/results/<device>.json
    plots: Path = Path("bench_out")
    batch: int | None = None
    heads: int | None = None
    seed: int = 0
    plot: bool = True
    progress: bool = True
    time_limit: float | None = None
    raise_errors: bool = False
    ceilings: bool = True
    resume: bool = False
    threads: int | None = None
    rounds: int = 1  # each shape's cases timed this many times, interleaved; the median kept

    def __getattr__(self, name: str):
        # cfg.impls, cfg.ns, cfg.warmup, ...: the preset's fields
        if name in Preset.__dataclass_fields__:
            return getattr(self.preset, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def batch_for(self, n: int) -> int:
        return self.batch if self.batch is not None else max(1, self.tokens // n)

    def heads_for(self, d: int) -> int:
        return self.heads if self.heads is not None else max(1, self.hidden // d)


def _causal_values(text: str | None) -> tuple[bool, ...] | None:
    return None if text is None else {"0": (False,), "1": (True,), "both": (False, True)}[text]


def speed_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench",
        description="Time flashtile against SDPA (flash, cuDNN, efficient, math) and "
                    "FlexAttention. "
                    "Subcommands: speed (default), memory, report, decode, variants, train, io, "
                    "cp, cpu ('python -m flashtile.bench help' lists them; '<subcommand> -h' for "
                    "each). "
                    "Unset selections come from the preset for the device (--quick for the "
                    "small one).")
    p.add_argument("--impl", nargs="+", default=None, metavar="NAME",
                   help=f"implementations, or 'all' ({', '.join(IMPLS)}); "
                        f"default on CUDA: {' '.join(GPU_IMPLS)}; on CPU: {' '.join(CPU_IMPLS)}")
    p.add_argument("--mode", nargs="+", default=None, metavar="MODE",
                   help=f"modes, or 'all' ({', '.join(MODES)}); default all")
    p.add_argument("--causal", choices=("0", "1", "both"), default=None, help="default both")
    p.add_argument("--d", nargs="+", default=None, metavar="D", help="head dims, e.g. 64 128 256")
    p.add_argument("--n", nargs="+", default=None, metavar="N",
                   help="sequence lengths, e.g. 512 1K 16K")
    p.add_argument("--dtype", nargs="+", default=None, metavar="DTYPE",
                   help=f"dtypes ({', '.join(DTYPES)}); default bf16 fp16 on CUDA, "
                        "fp32 bf16 on CPU")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="tokens per batch: batch = tokens // N "
                        "(default 16384 on CUDA, 2048 on CPU)")
    p.add_argument("--hidden", type=positive_int, default=None,
                   help="model width: heads = hidden // d (default 2048 on CUDA, 128 on CPU)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="fixed batch (overrides --tokens)")
    p.add_argument("--heads", type=positive_int, default=None,
                   help="fixed heads (overrides --hidden)")
    p.add_argument("--quick", action="store_true", help="small preset for a fast check")
    p.add_argument("--warmup", type=float, default=None,
                   help="warm-up time in ms (do_bench's warmup; default 25 on CUDA)")
    p.add_argument("--rep", type=float, default=None,
                   help="measured time in ms (do_bench's rep; default 100 on CUDA)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="time every case of a shape this many times, the cases interleaved (their "
                        "order rotated each round), and keep the median (default 1): steadier "
                        "ratios where one timing can be disturbed")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no new shape after this many seconds (what ran is still written)")
    p.add_argument("--no-device-ceilings", dest="ceilings", action="store_false",
                   help="skip the copy-bandwidth and matmul measurement (entry 'device')")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch.set_num_threads for the CPU path (default: torch's choice; 1 gives "
                        "steadier CPU timings on a busy machine)")
    p.add_argument("--resume", action="store_true",
                   help="skip the cases that the --out file already holds with status ok, oom or "
                        "unsupported for this device (to continue a cut-off run)")
    common_arguments(p, KEY, "the plots")
    return p


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse the speed benchmark's flags into a ``Config`` (unset selections from the preset)."""
    p = speed_parser()
    a = p.parse_args(argv)
    try:
        impls = parse_names(a.impl, list(IMPLS), "implementation")
        modes = parse_names(a.mode, list(MODES), "mode")
        ds = flatten(a.d, positive_int)
        ns = flatten(a.n, parse_seqlen)
        dtypes = flatten(a.dtype, parse_dtype)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    device = a.device or default_device()
    preset = dataclasses.replace(
        PRESETS[(device, bool(a.quick))],
        **{k: v for k, v in dict(impls=impls, modes=modes, causal=_causal_values(a.causal),
                                 dtypes=dtypes, ds=ds, ns=ns, tokens=a.tokens, hidden=a.hidden,
                                 warmup=a.warmup, rep=a.rep).items()
           if v is not None and v != ()})
    return Config(
        device=device, preset=preset,
        out=a.out, plots=a.plots, batch=a.batch, heads=a.heads, seed=a.seed,
        plot=a.plot, progress=a.progress, time_limit=a.time_limit, raise_errors=a.raise_errors,
        ceilings=a.ceilings, resume=a.resume, threads=a.threads, rounds=a.rounds,
    )


def build_plan(cfg: Config) -> list[Case]:
    """Every case, grouped so one input set serves all cases of a shape (dtype, d, n), and the
    modes of one (shape, causal) run back to back (FlexAttention compiles once per such set)."""
    plan = []
    for dtype in cfg.dtypes:
        for d in cfg.ds:
            for n in cfg.ns:
                batch, heads = cfg.batch_for(n), cfg.heads_for(d)
                for causal in cfg.causal:
                    for mode in cfg.modes:
                        for impl in cfg.impls:
                            plan.append(Case(impl, mode, causal, dtype, d, n, batch, heads))
    return plan

# --------------------------------------------------------------------------------------------
# Device ceilings
# --------------------------------------------------------------------------------------------

def _time_copy(device: torch.device, timer: Callable[[Callable], float],
               nbytes: int) -> tuple[float, int]:
    src = torch.randn(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copy():
        return dst.copy_(src)

    copy()
    synchronize(device)
    return timer(copy), src.numel() * src.element_size()


def _time_matmul(device: torch.device, timer: Callable[[Callable], float], n: int,
                 dtype: torch.dtype) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty_like(a)

    def matmul():
        return torch.mm(a, b, out=c)

    matmul()
    synchronize(device)
    return timer(matmul)


def measure_device_ceilings(device: torch.device | str, timer: Callable[[Callable], float],
                            copy_bytes: int | None = None, matmul_n: int | None = None,
                            matmul_dtype: str | None = None) -> dict[str, Any]:
    """Copy bandwidth (read + write bytes / time) and dense-matmul TFLOP/s of ``device``.

    CUDA defaults: a 1 GiB copy and a bf16 8192^3 matmul; CPU: 64 MiB and fp32 1024^3."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (1 << 30 if cuda else 64 << 20)
    matmul_n = matmul_n or (8192 if cuda else 1024)
    matmul_dtype = matmul_dtype or ("bf16" if cuda else "fp32")
    info: dict[str, Any] = runtime_env(device)
    info["date"] = utc_now()
    if cuda:
        props = torch.cuda.get_device_properties(device)
        info.update(cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, total_memory_bytes=props.total_memory)
    else:
        info.update(threads=torch.get_num_threads())

    copy_ms, nbytes = _time_copy(device, timer, copy_bytes)
    info.update(copy_bytes=nbytes, copy_ms=copy_ms,
                copy_bandwidth_GBps=2 * nbytes / (copy_ms * 1e-3) / 1e9)
    matmul_ms = _time_matmul(device, timer, matmul_n, DTYPES[matmul_dtype])
    info.update(matmul_shape=[matmul_n] * 3, matmul_dtype=matmul_dtype, matmul_ms=matmul_ms,
                matmul_tflops=2 * matmul_n ** 3 / (matmul_ms * 1e-3) / 1e12)
    empty_cache(device)
    return info


# --------------------------------------------------------------------------------------------
# Speed run
# --------------------------------------------------------------------------------------------


def case_key(case: Case, device_name: str) -> tuple:
    """``record_key`` of the record ``case`` produces on device ``device_name``."""
    return (device_name, case.impl, case.mode, case.causal, case.dtype, case.d, case.n,
            case.batch, case.heads)


def _done_records(cfg: Config, results: Path, device_name: str) -> dict[tuple, dict]:
    """Records of the results file that --resume does not run again."""
    if not cfg.resume:
        return {}
    return {record_key(r): r for r in load_records(results, KEY)
            if r.get("device") == device_name and r.get("status") in ("ok", "oom", "unsupported")}


def warm_up_gpu(device: torch.device, seconds: float = 2.0) -> None:
    """Keep the GPU busy with matmuls for ``seconds`` before the first timing: an idle GPU
    starts at low clocks, and the first cases of a sweep (the short, host-sensitive ones)
    would otherwise be timed while the clocks ramp up."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)
    del a


def run_speed(cfg: Config, timer: Callable[[Callable], float] | None = None,
              stdout=None) -> list[dict]:
    """Run every case of ``cfg``; merges the records into the results file after each shape,
    then writes the table (stdout), the device ceilings and the plots. Returns this run's
    records.

    Stops early (keeping what ran) when ``cfg.time_limit`` is exceeded between shapes, or after a
    CUDA error that leaves the context unusable."""
    stdout = stdout or sys.stdout
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    timer = timer or make_timer(device, cfg.warmup, cfg.rep)
    env = runtime_env(device)
    results = results_path(device, cfg.out)
    full_plan = build_plan(cfg)
    done = _done_records(cfg, results, env["device"])
    plan = [c for c in full_plan if case_key(c, env["device"]) not in done]
    if done:
        log(f"--resume: {len(full_plan) - len(plan)} of {len(full_plan)} cases already in "
             f"{results}")
    records: list[dict] = []
    progress = make_progress(len(plan), cfg.progress)
    start = time.monotonic()
    stop_reason = None
    reset_flex_cache()
    warm_up_gpu(device)
    try:
        i = 0
        while i < len(plan) and stop_reason is None:
            group_key = plan[i].shape_key
            group = []
            while i < len(plan) and plan[i].shape_key == group_key:
                group.append(plan[i])
                i += 1
            if cfg.time_limit is not None and time.monotonic() - start > cfg.time_limit:
                stop_reason = f"--time-limit {cfg.time_limit:g}s reached"
                break
            c0 = group[0]
            try:
                inputs = common.make_inputs(c0.batch, c0.n, c0.heads, c0.d, c0.dtype, device,
                                            cfg.seed)
                input_failure = None
            except Exception as exc:  # noqa: BLE001 - recorded for every case of the shape
                if cfg.raise_errors:
                    raise
                inputs, input_failure = None, (classify_error(exc, True), first_line(exc))
            timings: dict[int, list[dict]] = {j: [] for j in range(len(group))}
            for r in range(cfg.rounds if input_failure is None else 1):
                # rotated each round, so that no case always follows the same one
                for j in [(r + j) % len(group) for j in range(len(group))]:
                    case = group[j]
                    progress.set_description(case.label())
                    if input_failure is None:
                        rec = run_case(case, inputs, timer, env, cfg.raise_errors)
                    else:
                        rec = make_record(env, **case_fields(case), status=input_failure[0],
                                          error=f"making the inputs: {input_failure[1]}")
                    if rec["status"] == "error":
                        progress.write(f"error: {case.label()}: {rec['error']}")
                    timings[j].append(rec)
                    if r == 0:
                        progress.update(1)
                    if is_fatal(rec["error"]):
                        stop_reason = f"unrecoverable CUDA error in {case.label()}"
                        break
                if stop_reason is not None:
                    break
            records += [_median_record(timings[j]) for j in range(len(group)) if timings[j]]
            del inputs
            reset_flex_cache()
            gc.collect()
            empty_cache(device)
            merge_result(results, KEY, records)
    finally:
        progress.close()
        reset_flex_cache()
    if stop_reason is not None:
        log(f"{stop_reason}: ran {len(records)} of {len(plan)} cases")
    merge_result(results, KEY, records)
    if cfg.ceilings and not (stop_reason or "").startswith("unrecoverable"):
        try:
            ceilings = measure_device_ceilings(device, timer)
            write_result(results, DEVICE_KEY, ceilings)
            log(f"device: copy {ceilings['copy_bandwidth_GBps']:.0f} GB/s, "
                 f"{ceilings['matmul_dtype']} matmul {ceilings['matmul_tflops']:.3g} TFLOP/s")
        except Exception as exc:  # noqa: BLE001 - ceilings are informative only
            log(f"device ceilings not measured: {first_line(exc)}")
    shown = [done[k] for k in (case_key(c, env["device"]) for c in full_plan) if k in done]
    shown += records
    print(render_table(shown), file=stdout)
    written = [f"{results} [{KEY}]"]
    if cfg.plot:
        written += plot(shown, cfg.plots)
    log("wrote " + ", ".join(str(p) for p in written))
    return records



def _median_record(recs: list[dict]) -> dict:
    """One case's record over its rounds: the round with the median time among those that ran
    (the lower middle one for an even count), with every round's ``ms`` under ``ms_rounds``; the
    first round's record when none ran."""
    ok = sorted((r for r in recs if r["status"] == "ok"), key=lambda r: r["ms"])
    if not ok:
        return recs[0]
    rec = dict(ok[(len(ok) - 1) // 2])
    if len(recs) > 1:
        rec["ms_rounds"] = [r["ms"] for r in recs if r["status"] == "ok"]
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    """Run the speed benchmark; exit status 1 when a flashtile case failed with an unexpected
    error, 2 for usage problems."""
    cfg = parse_args(argv)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        log("--device cuda but CUDA is not available")
        return 2
    records = run_speed(cfg)
    return 1 if any(r["status"] == "error" for r in records) else 0


# --------------------------------------------------------------------------------------------
# Host cost per call (``python -m flashtile.bench overhead``)
# --------------------------------------------------------------------------------------------
def _per_call_us(fn: Callable[[], Any], n: int = 2000) -> tuple[float, float]:
    """``(wall, cpu)`` microseconds per call of ``fn`` over ``n`` calls (one block, between two
    device synchronisations): wall-clock time, and the CPU time of the process (every thread,
    ``time.process_time``), which leaves out the time the host's scheduler gives to others, the
    part of the wall time that spreads most on a shared machine."""
    torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return ((time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6)


HOST_ROUNDS = 9


def host_costs(rounds: int = HOST_ROUNDS) -> dict:
    """Microseconds per call on a tiny input (1 x 16 x 2 x 64 bf16, causal), where the GPU work
    is negligible, so this is the Python + launch cost: SDPA flash, flashtile's public forward
    and forward+backward, and the Triton forward launcher alone, each with direct launches off
    (``triton_run``) and on (``direct``); forward+backward with launch plans off and on; at 128
    positions (``n128``: the Hopper kernels' path on sm_90), the public forward with launch
    plans off and on, SDPA without a backend chosen, and forward+backward of both.

    The host's pace drifts between blocks of calls (on the H100 machine by up to 3x), so every
    measurement is a block of calls repeated over ``rounds`` rounds, all measurements one after
    another in each round (order rotated), and the median over rounds is reported (with the
    rounds under ``<name>_rounds``); beside each, the process's CPU time per call under
    ``<name>_cpu`` (median) and ``<name>_cpu_rounds``: steadier where other work shares the
    host (a host-bound loop spends its wall time on the CPU, whatever else runs)."""
    import flashtile
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..backends.spec import AttnSpec
    from ..backends.triton import forward
    from ..backends.triton.fastlaunch import direct_launches, launch_plans

    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    qg = q.clone().requires_grad_()
    spec = AttnSpec(0.125, -1, 0)
    qt, qtg = q.transpose(1, 2), qg.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # a contiguous output gradient as in training for the plans comparison (the gradient of
    # .sum() is an expanded tensor, which the backward's plans leave to the full path)
    k, v = qg.detach().clone().requires_grad_(), qg.detach().clone().requires_grad_()
    dout = torch.randn_like(q)
    flash = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
    # name: (call, calls per block, context)
    cases = {
        "sdpa_flash_fwd_us": (lambda: sdpa(qt, qt, qt, is_causal=True), 1000, flash),
        "sdpa_flash_fwd_bwd_us": (lambda: sdpa(qtg, qtg, qtg, is_causal=True).sum().backward(),
                                  250, flash),
    }
    for direct in (False, True):
        tag = "direct" if direct else "triton_run"
        ctx = (lambda d=direct: direct_launches(d))
        cases[f"flashtile_fwd_us_{tag}"] = (
            lambda: flashtile.flash_attn_func(q, q, q, causal=True), 1000, ctx)
        cases[f"flashtile_fwd_bwd_us_{tag}"] = (
            lambda: flashtile.flash_attn_func(qg, qg, qg, causal=True).sum().backward(), 250, ctx)
        cases[f"launcher_fwd_us_{tag}"] = (lambda: forward(q, q, q, spec), 1000, ctx)
    for plans in (False, True):
        cases[f"flashtile_fwd_bwd_us_direct_bwd_plans_{'on' if plans else 'off'}"] = (
            lambda: flashtile.flash_attn_func(qg, k, v, causal=True).backward(dout), 250,
            lambda p=plans: launch_plans(p))
    # 128 positions: on an H100 / H200 the Hopper kernels' path (its forward plans off / on),
    # elsewhere the Triton kernels'; SDPA without a backend chosen beside it
    q128 = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    qt128 = q128.transpose(1, 2)
    cases["sdpa_default_fwd_us_n128"] = (lambda: sdpa(qt128, qt128, qt128, is_causal=True), 1000,
                                         contextlib.nullcontext)
    for plans in (False, True):
        cases[f"flashtile_fwd_us_n128_plans_{'on' if plans else 'off'}"] = (
            lambda: flashtile.flash_attn_func(q128, q128, q128, causal=True), 1000,
            lambda p=plans: launch_plans(p))
    # forward + backward at 128 positions (on sm_90 the Hopper forward and fused backward,
    # through their plans), and SDPA's default on the same tensors in its layout
    qkv128 = [torch.randn_like(q128).requires_grad_() for _ in range(3)]
    dout128 = torch.randn_like(q128)
    qkv128t = [x.detach().transpose(1, 2).requires_grad_() for x in qkv128]
    cases["sdpa_default_fwd_bwd_us_n128"] = (
        lambda: sdpa(*qkv128t, is_causal=True).backward(dout128.transpose(1, 2)), 250,
        contextlib.nullcontext)
    cases["flashtile_fwd_bwd_us_n128"] = (
        lambda: flashtile.flash_attn_func(*qkv128, causal=True).backward(dout128), 250,
        contextlib.nullcontext)
    names = list(cases)
    for name in names:  # warm-up: compiles, records the plans
        fn, _, ctx = cases[name]
        with ctx():
            for _ in range(50):
                fn()
    times: dict = {name: [] for name in names}
    cpu: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, n, ctx = cases[name]
            with ctx():
                wall, used = _per_call_us(fn, n)
            times[name].append(wall)
            cpu[name].append(used)
    rec = {name: statistics.median(t) for name, t in times.items()}
    rec.update({f"{name}_rounds": t for name, t in times.items()})
    rec.update({f"{name}_cpu": statistics.median(t) for name, t in cpu.items()})
    rec.update({f"{name}_cpu_rounds": t for name, t in cpu.items()})
    return rec


def short_n() -> list[dict]:
    """Forward milliseconds at N=512 and 1K (16K tokens, hidden 2048, d=64 and 128, bf16,
    causal and not) through ``flash_attn_func`` with direct launches off and on, against SDPA
    flash; medians of ``triton.testing.do_bench``."""
    import flashtile
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from ..backends.triton.fastlaunch import direct_launches

    rows = []
    for d in (64, 128):
        for n in (512, 1024):
            b, h = 16384 // n, 2048 // d
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1)
                row = dict(d=d, n=n, causal=causal)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    row["sdpa_flash_ms"] = do_bench(
                        lambda: torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vt, is_causal=causal),
                        warmup=25, rep=100, return_mode="median")
                for direct in (False, True):
                    with direct_launches(direct):
                        row[f"flashtile_ms_{'direct' if direct else 'triton_run'}"] = do_bench(
                            lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
                            warmup=25, rep=100, return_mode="median")
                row["ratio_vs_fa2_direct"] = row["sdpa_flash_ms"] / row["flashtile_ms_direct"]
                row["tflops_direct"] = flops / row["flashtile_ms_direct"] / 1e9
                rows.append(row)
                log(json.dumps(row))
    return rows


def profile_call(n: int = 1000, top: int = 30) -> str:
    """The cProfile (by own time, ``top`` rows) of ``n`` forward+backward calls through the
    public call on a tiny input, direct launches on."""
    import cProfile
    import io
    import pstats

    import flashtile
    from ..backends.triton.fastlaunch import direct_launches

    q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        flashtile.flash_attn_func(q, q, q, causal=True).sum().backward()

    with direct_launches(True):
        for _ in range(50):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            step()
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def overhead_main(argv: Sequence[str] | None = None) -> int:
    """``python -m flashtile.bench overhead [--out FILE] [--profile] [--no-short-n]``: one
    record (entry ``overhead_direct`` of the device's results file) of :func:`host_costs`, :func:`short_n` and (``--profile``) :func:`profile_call`."""
    p = argparse.ArgumentParser(prog="python -m flashtile.bench overhead",
                                description="host cost per call and the short-sequence "
                                            "forward, direct launches and launch plans off "
                                            "and on (CUDA)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="results JSON (default benchmarks/results/<device>.json, entry "
                        "overhead_direct)")
    p.add_argument("--profile", action="store_true",
                   help="add a cProfile of forward+backward through the public call")
    p.add_argument("--no-short-n", dest="short_n", action="store_false",
                   help="skip the N=512/1K forwards")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        log("the overhead benchmark times CUDA launches; no CUDA device is available here")
        return 2
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": utc_now()}
    rec.update(host_costs())
    log(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in rec.items()}))
    if args.short_n:
        rec["short_n"] = short_n()
    if args.profile:
        rec["profile"] = profile_call()
        log(rec["profile"])
    out = write_result(results_path("cuda", args.out), "overhead_direct", rec)
    log(f"wrote {out} [overhead_direct]")
    return 0
