"""IO-awareness measured: DRAM and L2 bytes of attention under Nsight Compute (GPU).

The paper's claim is about bytes: standard attention moves ``Theta(N d + N^2)`` bytes through
HBM, FlashAttention ``Theta(N^2 d^2 / M)``.  This benchmark measures them per kernel with
Nsight Compute and puts them next to the model of ``flashtile.reference.algorithms``::

    python -m flashtile.bench io --quick                  # ~3 min on an H100
    python -m flashtile.bench io                          # all sweeps, ~6-8 min
    python -m flashtile.bench io report --doc docs/io.md   # tables, fig2.png, fig3.png

Sweeps (``--sweeps``):

``fig2``    the paper's Figure 2 shape (GPT-2 medium: N=1024, d=64, 16 heads, batch 64, bf16),
            forward and backward of standard attention (SDPA's math backend), FA2 (SDPA's
            flash backend), cuDNN (SDPA's cudnn backend) and flashtile.
``blocks``  flashtile with pinned tile shapes (``configs.override``): the forward's query tile
            ``block_m`` (= B_r, the tile that sets how often K and V are re-read), its key tile
            ``block_n`` (= B_c), the dK/dV kernel's ``block_n`` and the dQ kernel's ``block_m``.
``sparse``  block-sparse flashtile at the Figure 2 shape against the fraction of nonzero blocks.
``fig3``    Figure 3: fwd+bwd runtime (CUDA events, no profiler) and peak extra memory (CUDA
            allocator) against N for standard, FA2, cuDNN, Flex, flashtile and block-sparse
            flashtile (butterfly mask).

How: the ``ncu`` sweeps run a worker process (``python -m flashtile.bench.io worker``) under
``ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum,
lts__t_bytes.sum,gpu__time_duration.sum --csv --print-units base``.
The worker warms each case up, then runs exactly the measured calls (one forward, one
backward), each between two tiny marker kernels (:data:`BEGIN_MARKER`, :data:`END_MARKER`):
the kernels Nsight Compute reports between a begin and an end marker belong to that pass, in
order, whatever their names.  Every kernel is profiled, warm-ups included.  ``--nvtx`` limits
profiling to the NVTX range ``io`` around the measured calls; NVTX ranges belong to the thread
that opens them, and PyTorch runs a CUDA backward on its autograd thread, so with ``--nvtx``
the backward's kernels are missed: use it for forward sweeps only.

Records (entry ``io`` of the device's results file, ``benchmarks/results/<device>.json``; a run
replaces the records of the sweeps it ran), one per (case, pass) with the kernels nested:
``impl, pass, n, d, heads, batch, block_m, block_n, dram_read_bytes, dram_write_bytes,
l2_bytes, ms, compulsory_bytes`` plus ``sweep, density, kernels, model_dram_bytes,
model_l2_bytes, device, torch, triton, ncu, date``.  ``l2_bytes`` is ``lts__t_bytes.sum``: every
byte through the L2 slices (SM <-> L2 traffic plus L2's own fills and evictions).
``report`` prints the tables, draws ``fig2.png`` (the panels of Figure 2 that were measured:
left, middle, right) and ``fig3.png`` into ``--plots`` (default ``benchmarks/results``), and with
``--doc`` replaces the results section of a markdown file.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import io as _io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..reference import algorithms
from .common import RESULTS_DIR, env_set, read_results, results_path, update_result

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum",
           "gpu__time_duration.sum")
BEGIN_MARKER = "io_begin_marker_kernel"
END_MARKER = "io_end_marker_kernel"
NVTX_RANGE = "io"
IMPLS = ("standard", "fa2", "cudnn", "flashtile")
# flashtile_chunked: flashtile with FLASHTILE_BWD_CHUNK=auto (the backward a few batch entries
# at a time, so that the dK/dV kernel re-reads from L2 what the dQ kernel just read).  It only
# shows when ncu keeps L2 between kernels: the l2reuse sweep runs with --cache-control none
# (ncu's default, all, empties the caches before every profiled kernel).
# flashtile_deterministic: the backward without atomics (on Hopper the Triton dQ kernel and the
# Gluon dK/dV kernel instead of the one-kernel backward and its float32 dQ accumulator).
L2REUSE_IMPLS = ("flashtile", "flashtile_deterministic", "flashtile_chunked")
CACHE_CONTROL = {"l2reuse": "none"}  # per sweep; "all" otherwise
FIG3_IMPLS = ("standard", "fa2", "cudnn", "flex", "flashtile", "flashtile_sparse")
SWEEPS = ("fig2", "blocks", "sparse", "fig3", "l2reuse")
KEY = "io"  # the entry of the results file that holds the io records
# The paper's Figure 2 (A100, fwd+bwd at the GPT-2 medium shape).
PAPER_FIG2 = {"standard": {"gb": 40.3, "ms": 41.7}, "flashtile": {"gb": 4.4, "ms": 7.3}}

_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
          "kibyte": 2**10, "mibyte": 2**20, "gibyte": 2**30,
          "nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3,
          "ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
_METRIC_FIELDS = {"dram__bytes_read.sum": "dram_read_bytes",
                  "dram__bytes_write.sum": "dram_write_bytes",
                  "lts__t_bytes.sum": "l2_bytes", "gpu__time_duration.sum": "ms"}


# --------------------------------------------------------------------------- cases

@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration: an implementation at one shape, with optional pinned tile
    configs ``(block_m, block_n, num_warps, num_stages)`` for flashtile's three kernels."""
    sweep: str
    impl: str
    n: int = 1024
    d: int = 64
    heads: int = 16
    batch: int = 64
    dtype: str = "bfloat16"
    passes: tuple = ("fwd", "bwd")
    fwd: tuple | None = None
    dkdv: tuple | None = None
    dq: tuple | None = None
    density: float = 1.0
    sparse_block: int = 128
    knob: str = ""  # which tile the blocks sweep varies

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Case":
        d = dict(d)
        for key in ("passes", "fwd", "dkdv", "dq"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)


def _warps(block: int) -> int:
    return 8 if block >= 128 else 4


def build_cases(sweeps: Sequence[str], quick: bool) -> list[Case]:
    """The ncu cases of ``sweeps`` (``fig3`` has no ncu cases, see :func:`fig3_points`)."""
    cases: list[Case] = []
    if "fig2" in sweeps:
        cases += [Case("fig2", impl) for impl in IMPLS]
    if "l2reuse" in sweeps:
        cases += [Case("l2reuse", impl) for impl in L2REUSE_IMPLS]
    if "blocks" in sweeps:
        sizes = (16, 32, 64, 128) if not quick else (16, 64, 128)
        for b in sizes:
            cases.append(Case("blocks", "flashtile", passes=("fwd",), knob="fwd.block_m",
                              fwd=(b, 64, _warps(b), 3)))
        for b in sizes:
            cases.append(Case("blocks", "flashtile", passes=("fwd",), knob="fwd.block_n",
                              fwd=(64, b, 4, 3)))
        for b in sizes:
            cases.append(Case("blocks", "flashtile", passes=("bwd",), knob="dkdv.block_n",
                              dkdv=(64, b, _warps(b), 2), dq=(128, 64, 8, 3)))
        if not quick:
            for b in sizes:
                cases.append(Case("blocks", "flashtile", passes=("bwd",), knob="dq.block_m",
                                  dkdv=(64, 64, 4, 2), dq=(b, 64, _warps(b), 3)))
    if "sparse" in sweeps:
        for density in ((1.0, 0.5, 0.25, 0.125) if not quick else (1.0, 0.25)):
            cases.append(Case("sparse", "flashtile_sparse", density=density))
    return cases


def fig3_points(quick: bool) -> list[dict]:
    """Figure 3: fwd+bwd at d=64, 16 heads, bf16, batch * N = 16K tokens."""
    ns = (512, 2048, 8192) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    # Flex compiles per shape (~20-40 s each, forward and backward): three shapes at most
    flex_ns = (512, 8192) if quick else (512, 2048, 8192)
    return [dict(impl=impl, n=n, batch=max(1, 16384 // n), heads=16, d=64, dtype="bfloat16")
            for n in ns for impl in FIG3_IMPLS if impl != "flex" or n in flex_ns]


# --------------------------------------------------------------------------- ncu output

@dataclasses.dataclass
class KernelRecord:
    """One profiled kernel launch: its ncu ID, name and metrics in bytes / milliseconds."""
    id: int
    name: str
    metrics: dict

    def field(self, metric: str) -> float | None:
        return self.metrics.get(metric)


def _number(value: str, unit: str, metric: str = "") -> float | None:
    text = value.strip().replace(",", "")
    if text in ("", "n/a", "N/A"):
        return None
    try:
        x = float(text)
    except ValueError:
        return None
    unit = unit.strip().lower()
    if unit not in _UNITS and metric.startswith("gpu__time_duration"):
        # ``--print-units base`` gives durations in nanoseconds, whatever the unit cell says
        return x * 1e-6
    return x * _UNITS.get(unit, 1.0)


def _csv_lines(text: str) -> list[str]:
    # ncu's log interleaves "==PROF==" lines and the program's output with the CSV
    return [line for line in text.splitlines() if line.startswith('"')]


def parse_ncu_csv(text: str) -> list[KernelRecord]:
    """Kernels of ncu ``--csv`` output, in launch order.

    Accepts the default ``details`` page (one row per metric: ``"ID", ..., "Kernel Name", ...,
    "Metric Name", "Metric Unit", "Metric Value"``) and the ``raw`` page (one row per kernel,
    one column per metric, the second row giving units).  Values are converted to bytes and
    milliseconds from their units (``byte``/``Kbyte``/``Mbyte``/``Gbyte``, ``nsecond``/
    ``usecond``/``msecond``/``second``); thousands separators are dropped.
    """
    rows = list(csv.reader(_io.StringIO("\n".join(_csv_lines(text)))))
    if not rows:
        return []
    header = rows[0]
    kernels: dict[int, KernelRecord] = {}
    if "Metric Name" in header:
        i_id, i_name = header.index("ID"), header.index("Kernel Name")
        i_metric, i_unit, i_value = (header.index("Metric Name"), header.index("Metric Unit"),
                                     header.index("Metric Value"))
        for row in rows[1:]:
            if len(row) != len(header) or row == header:
                continue
            kid = int(row[i_id])
            rec = kernels.setdefault(kid, KernelRecord(kid, row[i_name], {}))
            value = _number(row[i_value], row[i_unit], row[i_metric])
            if value is not None:
                rec.metrics[row[i_metric]] = value
    else:
        i_id, i_name = header.index("ID"), header.index("Kernel Name")
        units = rows[1] if len(rows) > 1 and not rows[1][i_id].strip().isdigit() else None
        for row in rows[2 if units else 1:]:
            if len(row) != len(header) or not row[i_id].strip().isdigit():
                continue
            kid = int(row[i_id])
            rec = kernels.setdefault(kid, KernelRecord(kid, row[i_name], {}))
            for j, col in enumerate(header):
                if col in METRICS:
                    value = _number(row[j], units[j] if units else "", col)
                    if value is not None:
                        rec.metrics[col] = value
    return [kernels[k] for k in sorted(kernels)]


def short_name(name: str) -> str:
    """``void at::native::(anonymous)::foo<float>(...)`` -> ``foo``: the kernel's own name."""
    base = name.split("(")[0].strip()
    base = base.split("<")[0].strip()
    return base.split("::")[-1].split(" ")[-1]


def split_by_markers(kernels: Sequence[KernelRecord]) -> list[list[KernelRecord]]:
    """The kernels between each begin marker and the next end marker, in order; kernels
    outside such a pair (warm-ups when every kernel is profiled) are dropped."""
    groups: list[list[KernelRecord]] = []
    current: list[KernelRecord] | None = None
    for k in kernels:
        name = short_name(k.name)
        if name == BEGIN_MARKER:
            current = []
            groups.append(current)
        elif name == END_MARKER:
            current = None
        elif current is not None:
            current.append(k)
    return groups


# --------------------------------------------------------------------------- the model

_FLASHTILE_KERNELS = {"attn_fwd_kernel": "fwd", "attn_bwd_dq_kernel": "dq",
                      "attn_bwd_dkdv_kernel": "dkdv", "attn_fwd_sm90_kernel": "fwd",
                      "attn_bwd_sm90_kernel": "dkdv"}
# the one-kernel backward (configs["fused"]): its prologue, the kernel and the accumulator's
# conversion (PyTorch's copy kernel)
_FUSED_KERNELS = {"attn_bwd_delta_kernel": "delta", "attn_bwd_sm90_kernel": "bwd"}
_FUSED_PASSES = ("delta", "bwd", "dq")


def problem_of(case: Case | dict) -> algorithms.Problem:
    c = case if isinstance(case, dict) else dataclasses.asdict(case)
    return algorithms.Problem(n=c["n"], d=c["d"], heads=c["heads"], batch=c["batch"],
                            dtype_bytes=2 if c["dtype"] in ("bfloat16", "float16") else 4,
                            density=c.get("density", 1.0))


def model_kernels(case: dict, configs: dict) -> dict[str, algorithms.KernelIO]:
    """The model's kernels for a flashtile case with the tile configs the worker used."""
    p = problem_of(case)
    fwd = algorithms.flashtile_forward(p, *configs["fwd"][:2])
    if configs.get("fused"):
        bwd = algorithms.flashtile_backward_fused(p, *configs["dkdv"][:2])
    else:
        bwd = algorithms.flashtile_backward(p, tuple(configs["dkdv"][:2]),
                                            tuple(configs["dq"][:2]),
                                            l2_reuse=case.get("impl") == "flashtile_chunked")
    return {k.kernel: k for k in fwd + bwd}


# --------------------------------------------------------------------------- the worker

def _markers(device: str = "cuda"):
    """Two tiny kernels whose names delimit a measured pass in the profile."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def io_begin_marker_kernel(X):
        tl.store(X, 1)

    @triton.jit
    def io_end_marker_kernel(X):
        tl.store(X, 2)

    buf = torch.zeros(1, dtype=torch.int32, device=device)
    if not os.environ.get("TRITON_INTERPRET"):
        for kernel in (io_begin_marker_kernel, io_end_marker_kernel):
            kernel.warmup(buf, grid=(1,))  # compiled now, launched only around measured passes
    return (lambda: io_begin_marker_kernel[(1,)](buf)), (lambda: io_end_marker_kernel[(1,)](buf))


def _dtype(name: str):
    import torch
    return getattr(torch, name)


def _sdpa_backend(impl: str):
    from torch.nn.attention import SDPBackend
    return {"standard": SDPBackend.MATH, "fa2": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}[impl]


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _random_block_mask(rows: int, cols: int, density: float, device: str, seed: int = 0):
    """Bool ``(1, 1, rows, cols)``: ``round(density * cols)`` random blocks in every row."""
    import torch
    g = torch.Generator().manual_seed(seed)
    per_row = max(1, round(density * cols))
    order = torch.rand(rows, cols, generator=g).argsort(dim=1)[:, :per_row]
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    mask.scatter_(1, order, True)
    return mask[None, None].to(device)


class Runner:
    """``fwd()`` and ``bwd(out)`` of one implementation on fresh random inputs."""

    def __init__(self, impl: str, n: int, d: int, heads: int, batch: int, dtype: str,
                 density: float = 1.0, sparse_block: int = 128, configs: dict | None = None,
                 block_mask=None, device: str = "cuda"):
        import torch
        self.impl, self.configs = impl, configs or {}
        dt = _dtype(dtype)
        sdpa = impl in ("standard", "fa2", "cudnn", "flex")
        shape = (batch, heads, n, d) if sdpa else (batch, n, heads, d)
        self.q, self.k, self.v = (torch.randn(shape, device=device, dtype=dt, requires_grad=True)
                                  for _ in range(3))
        self.do = torch.randn(shape, device=device, dtype=dt)
        self.mask = block_mask
        if impl == "flashtile_sparse" and block_mask is None:
            rows = math.ceil(n / sparse_block)
            self.mask = _random_block_mask(rows, rows, density, device)
        self.sparse_block = sparse_block
        if impl == "flex":
            from torch.nn.attention.flex_attention import flex_attention
            self._flex = torch.compile(flex_attention, dynamic=False)

    def _context(self):
        if self.impl in ("standard", "fa2", "cudnn"):
            from torch.nn.attention import sdpa_kernel
            return sdpa_kernel([_sdpa_backend(self.impl)])
        stack = contextlib.ExitStack()
        if self.impl == "flashtile_chunked":
            stack.enter_context(env_set("FLASHTILE_BWD_CHUNK", "auto"))
        if self.impl.startswith("flashtile") and self.configs:
            # pinned tiles are the portable Triton kernels' (the Hopper kernels have their own)
            from ..backends.triton.configs import KernelConfig, override
            stack.enter_context(env_set("FLASHTILE_SM90", "0"))
            stack.enter_context(override(**{k: KernelConfig(*v) for k, v in self.configs.items()}))
        return stack

    def fwd(self):
        import torch.nn.functional as F
        import flashtile
        with self._context():
            if self.impl in ("standard", "fa2", "cudnn"):
                return F.scaled_dot_product_attention(self.q, self.k, self.v)
            if self.impl == "flex":
                return self._flex(self.q, self.k, self.v)
            if self.impl == "flashtile_sparse":
                return flashtile.block_sparse_attn_func(
                    self.q, self.k, self.v, self.mask,
                    block_size=(self.sparse_block, self.sparse_block))
            return flashtile.flash_attn_func(
                self.q, self.k, self.v, deterministic=self.impl == "flashtile_deterministic")

    def bwd(self, out):
        import torch
        with self._context():
            return torch.autograd.grad(out, (self.q, self.k, self.v), self.do)


def used_configs(case: Case, device: str = "cuda", run: "Runner | None" = None) -> dict:
    """The (block_m, block_n, warps, stages) flashtile uses for ``case``: the pinned ones (which
    select the portable Triton kernels), the Hopper kernels' tiles where they take the call
    (``run``'s inputs on an sm_90 GPU), or the tuned defaults for the shape."""
    import torch
    from ..backends.triton.configs import get_config
    out = {}
    for pass_ in ("fwd", "dkdv", "dq"):
        pinned = getattr(case, pass_)
        if pinned is not None:
            out[pass_] = list(pinned)
        else:
            c = get_config(pass_, case.d, False, _dtype(case.dtype), torch.device(device), case.n)
            out[pass_] = [c.block_m, c.block_n, c.num_warps, c.num_stages]
    if run is not None and not run.configs and case.impl.startswith("flashtile") \
            and case.impl != "flashtile_sparse":
        from ..backends.spec import AttnSpec
        from ..backends.triton import launch_sm90 as sm90
        spec = AttnSpec(softmax_scale=case.d ** -0.5)
        warps = 3 * sm90.NUM_WARPS  # two consumer warpgroups and the producer's
        if sm90.eligible(run.q, run.k, run.v, spec):
            out["fwd"] = [sm90.BLOCK_M, sm90.block_n(case.d), warps, sm90.STAGES]
        deterministic = case.impl != "flashtile" or not sm90.fused_pays(case.n, case.n, False,
                                                                          case.d)
        if sm90.bwd_eligible(run.q, run.k, run.v, run.do, run.k, run.v, spec, deterministic):
            out["dkdv"] = [sm90.bwd_rows(case.d), sm90.BWD_BLOCK_N, warps, sm90.STAGES]
            out["fused"] = not deterministic
    return out


def run_worker(plan_path: str, log_path: str, device: str = "cuda") -> None:
    """Run the cases of ``plan_path``; append one JSON line per measured pass (in marker
    order) to ``log_path``, or one with ``error`` for a case that failed.  (``device`` other
    than cuda only checks the flow: no NVTX range there.)"""
    import torch
    cuda = device.startswith("cuda")
    cases = [Case.from_json(c) for c in json.loads(Path(plan_path).read_text())]
    begin, end = _markers(device)
    with open(log_path, "a") as log:
        for index, case in enumerate(cases):
            pinned = {k: getattr(case, k) for k in ("fwd", "dkdv", "dq") if getattr(case, k)}
            open_pass = None  # a pass between begin() and its logged entry
            try:
                run = Runner(case.impl, case.n, case.d, case.heads, case.batch, case.dtype,
                             case.density, case.sparse_block, pinned, device=device)
                configs = (used_configs(case, device, run) if case.impl.startswith("flashtile")
                           else {})
                out = run.fwd()  # warm-up (compiles), outside the range
                run.bwd(out)
                out = run.fwd() if "fwd" not in case.passes else None
                _sync(device)
                if cuda:
                    torch.cuda.nvtx.range_push(NVTX_RANGE)
                try:
                    for pass_ in case.passes:
                        begin()
                        open_pass = pass_
                        if pass_ == "fwd":
                            out = run.fwd()
                        else:
                            run.bwd(out)
                        _sync(device)
                        end()
                        log.write(json.dumps(dict(index=index, pass_=pass_, configs=configs))
                                  + "\n")
                        open_pass = None
                    _sync(device)
                finally:
                    if cuda:
                        torch.cuda.nvtx.range_pop()
                del run, out
            except Exception as exc:  # one failing implementation must not end the sweep
                _sync(device)
                entry = dict(index=index, error=f"{type(exc).__name__}: {exc}"[:300])
                if open_pass is not None:  # its begin marker ran: close the group, skip it
                    end()
                    entry.update(pass_=open_pass, marked=True)
                log.write(json.dumps(entry) + "\n")
            log.flush()
            if cuda:
                torch.cuda.empty_cache()


def _time_ms(fn, reps: int) -> float:
    import torch
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def run_fig3_worker(quick: bool, out_path: str, reps: int = 5) -> None:
    """Figure 3 points: fwd+bwd time (CUDA events) and peak extra memory; JSON lines."""
    import torch
    from ..block_sparse import butterfly_block_mask
    with open(out_path, "a") as log:
        for point in fig3_points(quick):
            rec = dict(point, sweep="fig3", **{"pass": "fwd_bwd"})
            run = mask = None
            try:
                if point["impl"] == "flashtile_sparse":
                    mask = butterfly_block_mask(point["n"], point["n"], (128, 128), device="cuda")
                    rec["density"] = float(mask.float().mean())
                run = Runner(point["impl"], point["n"], point["d"], point["heads"],
                             point["batch"], point["dtype"], block_mask=mask, sparse_block=128)

                def step():
                    run.bwd(run.fwd())
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
                rec["ms"] = _time_ms(step, reps)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                rec["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
            except torch.OutOfMemoryError:
                rec["error"] = "out of memory"
            except Exception as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                run = mask = step = None
            torch.cuda.empty_cache()
            log.write(json.dumps(rec) + "\n")
            log.flush()


# --------------------------------------------------------------------------- records

def _kernel_fields(k: KernelRecord) -> dict:
    f = {field: k.metrics.get(metric) for metric, field in _METRIC_FIELDS.items()}
    return dict(name=short_name(k.name), **f)


def build_records(cases: Sequence[Case], entries: Sequence[dict],
                  groups: Sequence[Sequence[KernelRecord]], env: dict) -> list[dict]:
    """Join the worker's log (one entry per measured pass, errors included) with the kernel
    groups between markers (one per measured pass, same order) into records."""
    records, g = [], 0
    for entry in entries:
        case = cases[entry["index"]]
        base = dict(env, sweep=case.sweep, impl=case.impl, n=case.n, d=case.d, heads=case.heads,
                    batch=case.batch, dtype=case.dtype, density=case.density, knob=case.knob)
        if "error" in entry:
            records.append(dict(base, **{"pass": entry.get("pass_")}, error=entry["error"]))
            g += 1 if entry.get("marked") else 0  # the failed pass's kernels
            continue
        pass_ = entry["pass_"]
        kernels = [_kernel_fields(k) for k in groups[g]] if g < len(groups) else []
        g += 1
        p = problem_of(base)
        rec = dict(base, **{"pass": pass_}, block_m=None, block_n=None,
                   compulsory_bytes=algorithms.compulsory(p, pass_), kernels=kernels)
        for field in ("dram_read_bytes", "dram_write_bytes", "l2_bytes", "ms"):
            values = [k[field] for k in kernels if k[field] is not None]
            rec[field] = sum(values) if values else None
        configs = entry.get("configs") or {}
        if configs:
            main = configs["fwd"] if pass_ == "fwd" else configs["dkdv"]
            rec["block_m"], rec["block_n"] = main[0], main[1]
            rec["configs"] = configs
            model = model_kernels(base, configs)
            names = (["fwd"] if pass_ == "fwd" else list(_FUSED_PASSES) if configs.get("fused")
                     else ["dq", "dkdv"])
            rec["model_dram_bytes"] = algorithms.dram_bytes(p, [model[n] for n in names])
            rec["model_l2_bytes"] = sum(model[n].tile for n in names)
            for k in kernels:
                kinds = _FUSED_KERNELS if configs.get("fused") and pass_ != "fwd" else {}
                m = model.get(kinds.get(k["name"], _FLASHTILE_KERNELS.get(k["name"], "")))
                if m is not None:
                    k["model_dram_bytes"], k["model_l2_bytes"] = m.dram, m.tile
        records.append(rec)
    return records


def environment(ncu: str | None = None) -> dict:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               torch=torch.__version__, triton=triton_version,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if ncu:
        try:
            env["ncu"] = subprocess.run([ncu, "--version"], capture_output=True, text=True,
                                        timeout=60).stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["ncu"] = None
    return env


def ncu_command(ncu: str, plan: str, log: str, nvtx: bool,
                cache_control: str = "all") -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--cache-control", cache_control, "--metrics",
           ",".join(METRICS), "--csv", "--print-units", "base"]
    if nvtx:
        cmd += ["--nvtx", "--nvtx-include", f"{NVTX_RANGE}/"]
    return cmd + [sys.executable, "-m", "flashtile.bench.io", "worker", "--plan", plan,
                  "--log", log]


def _read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_ncu_sweeps(cases: list[Case], ncu: str, nvtx: bool, workdir: Path,
                   timeout: int, cache_control: str = "all") -> list[dict]:
    plan, log, csv_path = workdir / "plan.json", workdir / "log.jsonl", workdir / "ncu.csv"
    plan.write_text(json.dumps([c.to_json() for c in cases]))
    cmd = ncu_command(ncu, str(plan), str(log), nvtx, cache_control)
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    with open(csv_path, "w") as sink:  # ncu prints the CSV on stdout, progress on stderr
        proc = subprocess.run(cmd, env=env, timeout=timeout, stdout=sink)
    if proc.returncode != 0:
        print(f"ncu exited with {proc.returncode}; keeping what was recorded", flush=True)
    kernels = parse_ncu_csv(csv_path.read_text()) if csv_path.exists() else []
    groups = split_by_markers(kernels)
    entries = _read_lines(log)
    measured = [e for e in entries if "error" not in e or e.get("marked")]
    print(f"{len(kernels)} kernels profiled, {len(groups)} marked groups, {len(measured)} "
          f"measured passes, {len(entries) - len(measured)} failed cases", flush=True)
    if len(groups) != len(measured):
        print("warning: groups and passes differ (no kernels at all: run without --nvtx)", flush=True)
    return build_records(cases, entries, groups, dict(environment(ncu),
                                                      ncu_cache_control=cache_control))


def run_fig3(quick: bool, workdir: Path, timeout: int) -> list[dict]:
    out = workdir / "fig3.jsonl"
    cmd = [sys.executable, "-m", "flashtile.bench.io", "fig3-worker", "--out", str(out)]
    if quick:
        cmd.append("--quick")
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1")
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, timeout=timeout)
    meta = environment()
    return [dict(meta, **r) for r in _read_lines(out)]


# --------------------------------------------------------------------------- report

def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.0f}"


def _by_kernel(kernels: list[dict]) -> list[dict]:
    """One row per kernel name, in launch order: the launches of a kernel (a chunked backward
    launches each kernel once per chunk) summed, ``launches`` counted, the model's numbers
    (those of the whole pass's kernel) kept once."""
    rows: dict[str, dict] = {}
    for k in kernels:
        row = rows.get(k["name"])
        if row is None:
            rows[k["name"]] = dict(k, launches=1)
            continue
        row["launches"] += 1
        for field in ("dram_read_bytes", "dram_write_bytes", "l2_bytes", "ms"):
            if k.get(field) is not None:
                row[field] = (row.get(field) or 0) + k[field]
    return list(rows.values())


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fwd_bwd(records: Iterable[dict], **match) -> dict[str, dict]:
    """Per impl, the fwd and bwd records of ``match`` summed into one fwd+bwd row."""
    out: dict[str, dict] = {}
    for r in records:
        if (r.get("pass") not in ("fwd", "bwd") or r.get("error")
                or any(r.get(k) != v for k, v in match.items())):
            continue
        row = out.setdefault(r["impl"], dict(impl=r["impl"], dram=0, l2=0, ms=0.0, comp=0,
                                             model=0, passes=[]))
        row["passes"].append(r["pass"])
        row["dram"] += (r.get("dram_read_bytes") or 0) + (r.get("dram_write_bytes") or 0)
        row["l2"] += r.get("l2_bytes") or 0
        row["ms"] += r.get("ms") or 0.0
        row["comp"] += r.get("compulsory_bytes") or 0
        row["model"] += r.get("model_dram_bytes") or 0
    return out


def render_markdown(records: list[dict]) -> str:
    """Tables of every sweep found in ``records``, for docs/io.md."""
    parts = []
    env = next((r for r in records if r.get("device")), {})
    parts.append(f"Measured on {env.get('device', '?')} (torch {env.get('torch', '?')}, "
                 f"triton {env.get('triton', '?')}, {env.get('ncu', 'ncu ?')}, "
                 f"{env.get('date', '?')}).\n")
    fig2 = _fwd_bwd(records, sweep="fig2")
    if fig2:
        p = algorithms.figure2_problem()
        rows = ["| impl | DRAM GB (fwd+bwd) | x compulsory | L2 GB | kernel ms | model GB | paper A100 GB / ms |",
                "|---|---|---|---|---|---|---|"]
        for impl in IMPLS:
            r = fig2.get(impl)
            if r is None:
                continue
            paper = PAPER_FIG2.get(impl)
            model = (algorithms.standard(p) if impl == "standard" else r["model"]) or None
            paper_cell = "-" if paper is None else "{gb} / {ms}".format(**paper)
            rows.append(f"| {impl} | {_gb(r['dram'])} | {r['dram'] / r['comp']:.2f} | "
                        f"{_gb(r['l2'])} | {_ms(r['ms'])} | {_gb(model)} | {paper_cell} |")
        parts.append("### Figure 2 (left): GPT-2 medium shape, fwd+bwd\n\n" + "\n".join(rows))
        kernel_rows = ["| impl | pass | kernel | DRAM read MB | DRAM write MB | L2 MB | ms | model DRAM MB | model L2 MB |",
                       "|---|---|---|---|---|---|---|---|---|"]
        for r in records:
            if r.get("sweep") != "fig2" or not r.get("kernels"):
                continue
            for k in _by_kernel(r["kernels"]):
                model_dram, model_l2 = (_mb(k.get("model_dram_bytes")), _mb(k.get("model_l2_bytes")))
                launches = f" ×{k['launches']}" if k["launches"] > 1 else ""
                kernel_rows.append(
                    f"| {r['impl']} | {r['pass']} | `{k['name'][:60]}`{launches} | "
                    f"{_mb(k['dram_read_bytes'])} | {_mb(k['dram_write_bytes'])} | "
                    f"{_mb(k['l2_bytes'])} | {_ms(k['ms'])} | {model_dram} | {model_l2} |")
        parts.append("Per kernel:\n\n" + "\n".join(kernel_rows))
    reuse = _fwd_bwd(records, sweep="l2reuse")
    if reuse:
        rows = ["| impl | DRAM GB (fwd+bwd) | x compulsory | L2 GB | kernel ms | model GB |",
                "|---|---|---|---|---|---|"]
        for impl in L2REUSE_IMPLS:
            r = reuse.get(impl)
            if r is not None:
                rows.append(f"| {impl} | {_gb(r['dram'])} | {r['dram'] / r['comp']:.2f} | "
                            f"{_gb(r['l2'])} | {_ms(r['ms'])} | {_gb(r['model'] or None)} |")
        parts.append("### L2 kept between kernels (`--cache-control none`), Figure 2 shape\n\n"
                     + "\n".join(rows))
    blocks = [r for r in records if r.get("sweep") == "blocks" and r.get("pass")
              and not r.get("error")]
    if blocks:
        rows = ["| tile varied | (block_m, block_n) | DRAM GB | model DRAM GB | L2 GB | model L2 GB | ms |",
                "|---|---|---|---|---|---|---|"]
        for r in blocks:
            dram = (r.get("dram_read_bytes") or 0) + (r.get("dram_write_bytes") or 0)
            # the varied kernel's own tile (a bwd record's block_m/block_n are dK/dV's)
            tile = (r.get("configs") or {}).get(r["knob"].split(".")[0]) or [r.get("block_m"),
                                                                           r.get("block_n")]
            rows.append(f"| {r['knob']} | ({tile[0]}, {tile[1]}) | {_gb(dram)} | "
                        f"{_gb(r.get('model_dram_bytes'))} | {_gb(r.get('l2_bytes'))} | "
                        f"{_gb(r.get('model_l2_bytes'))} | {_ms(r.get('ms'))} |")
        parts.append("### Figure 2 (middle): tile sizes (flashtile, one kernel's tile varied)\n\n"
                     + "\n".join(rows))
    sparse = [r for r in records if r.get("sweep") == "sparse" and r.get("pass")
              and not r.get("error")]
    if sparse:
        rows = ["| density | DRAM GB (fwd+bwd) | model DRAM GB | L2 GB | model L2 GB | ms |",
                "|---|---|---|---|---|---|"]
        for density in sorted({r["density"] for r in sparse}, reverse=True):
            sel = [r for r in sparse if r["density"] == density]
            dram = sum((r.get("dram_read_bytes") or 0) + (r.get("dram_write_bytes") or 0) for r in sel)
            rows.append(f"| {density:g} | {_gb(dram)} | {_gb(sum(r.get('model_dram_bytes') or 0 for r in sel))} | "
                        f"{_gb(sum(r.get('l2_bytes') or 0 for r in sel))} | "
                        f"{_gb(sum(r.get('model_l2_bytes') or 0 for r in sel))} | "
                        f"{_ms(sum(r.get('ms') or 0 for r in sel))} |")
        parts.append("### Figure 2 (right): block-sparse flashtile against density\n\n" + "\n".join(rows))
    fig3 = [r for r in records if r.get("sweep") == "fig3"]
    if fig3:
        ns = sorted({r["n"] for r in fig3})
        impls = [i for i in FIG3_IMPLS if any(r["impl"] == i for r in fig3)]
        for title, key, fmt in (("fwd+bwd ms", "ms", lambda x: f"{x:.2f}"),
                                ("peak extra memory GB", "peak_extra_bytes", lambda x: f"{x / 1e9:.2f}")):
            rows = ["| impl | " + " | ".join(f"N={n}" for n in ns) + " |",
                    "|---|" + "---|" * len(ns)]
            for impl in impls:
                cells = []
                for n in ns:
                    r = next((r for r in fig3 if r["impl"] == impl and r["n"] == n), None)
                    if r is None:
                        cells.append("-")
                    elif r.get("error"):
                        cells.append("OOM" if "memory" in r["error"] else "error")
                    else:
                        cells.append(fmt(r[key]))
                rows.append(f"| {impl} | " + " | ".join(cells) + " |")
            parts.append(f"### Figure 3: {title} (d=64, 16 heads, batch x N = 16K, bf16)\n\n"
                         + "\n".join(rows))
    errors = [r for r in records if r.get("error")]
    if errors:
        parts.append("Failed cases:\n\n" + "\n".join(
            f"- {r['sweep']} {r['impl']} n={r['n']}: {r['error']}" for r in errors))
    return "\n\n".join(parts) + "\n"


DOC_BEGIN = "<!-- io-results:begin (python -m flashtile.bench.io report ... --doc) -->"
DOC_END = "<!-- io-results:end -->"


def update_doc(doc: Path, markdown: str) -> None:
    """Replace the text between :data:`DOC_BEGIN` and :data:`DOC_END` in ``doc``."""
    text = doc.read_text()
    i, j = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    doc.write_text(text[:i] + "\n\n" + markdown + "\n" + text[j:])


def plot(records: list[dict], out_dir: Path) -> list[Path]:
    """``fig2.png`` (one panel per part of Figure 2 that was measured: left, the bytes and time
    of each implementation; middle, flashtile's tile sizes; right, block-sparse density) and
    ``fig3.png``; none without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", flush=True)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig2 = _fwd_bwd(records, sweep="fig2")
    blocks = [r for r in records if r.get("sweep") == "blocks" and r.get("pass")
              and not r.get("error")]
    sparse = [r for r in records if r.get("sweep") == "sparse" and r.get("pass")
              and not r.get("error")]
    panels = [name for name, have in (("left", fig2), ("middle", blocks), ("right", sparse))
              if have]
    if panels:
        fig = plt.figure(figsize=(13, 3.8 * len(panels)))
        subfigs = fig.subfigures(len(panels), 1, squeeze=False)[:, 0]
        for sub, name in zip(subfigs, panels):
            if name == "left":
                impls = [i for i in IMPLS if i in fig2]
                a1, a2 = sub.subplots(1, 2)
                a1.bar(impls, [fig2[i]["dram"] / 1e9 for i in impls], color="tab:blue",
                       label="measured")
                a1.axhline(fig2[impls[0]]["comp"] / 1e9, color="k", ls="--", lw=1,
                           label="compulsory")
                a1.set_ylabel("HBM GB (fwd+bwd)")
                a1.legend(fontsize=8)
                a2.bar(impls, [fig2[i]["ms"] for i in impls], color="tab:orange")
                a2.set_ylabel("kernel time ms (ncu)")
                for a in (a1, a2):
                    a.tick_params(axis="x", labelrotation=20)
                sub.suptitle("Figure 2 left: N=1024, d=64, 16 heads, batch 64, bf16")
            elif name == "middle":
                axes = sub.subplots(1, 3)
                for knob in sorted({r["knob"] for r in blocks}):
                    sel = [r for r in blocks if r["knob"] == knob]
                    part = knob.split(".")
                    size = [r["configs"][part[0]][0 if part[1] == "block_m" else 1] for r in sel]
                    dram = [((r.get("dram_read_bytes") or 0) + (r.get("dram_write_bytes") or 0))
                            / 1e9 for r in sel]
                    line = axes[0].plot(size, dram, "o-", label=knob)[0]
                    color = line.get_color()
                    axes[0].plot(size, [(r.get("model_dram_bytes") or 0) / 1e9 for r in sel],
                                 "x:", color=color)
                    axes[1].plot(size, [(r.get("l2_bytes") or 0) / 1e9 for r in sel], "o-",
                                 color=color, label=knob)
                    axes[1].plot(size, [(r.get("model_l2_bytes") or 0) / 1e9 for r in sel],
                                 "x:", color=color)
                    axes[2].plot(size, [r.get("ms") or 0 for r in sel], "o-", color=color,
                                 label=knob)
                for a, label in zip(axes, ("HBM GB (o measured, x model)",
                                           "L2 GB (o lts__t_bytes, x model tile bytes)",
                                           "kernel ms")):
                    a.set_xscale("log", base=2)
                    a.set_xlabel("tile size varied")
                    a.set_ylabel(label)
                axes[2].legend(fontsize=7)
                sub.suptitle("Figure 2 middle: flashtile tile sizes at the Figure 2 shape")
            else:
                ds = sorted({r["density"] for r in sparse})
                total = {d: [r for r in sparse if r["density"] == d] for d in ds}
                a1, a2 = sub.subplots(1, 2)
                a1.plot(ds, [sum((r.get("dram_read_bytes") or 0) + (r.get("dram_write_bytes") or 0)
                                 for r in total[d]) / 1e9 for d in ds], "o-", label="HBM measured")
                a1.plot(ds, [sum(r.get("l2_bytes") or 0 for r in total[d]) / 1e9 for d in ds],
                        "s-", label="L2 measured")
                a1.plot(ds, [sum(r.get("model_l2_bytes") or 0 for r in total[d]) / 1e9
                             for d in ds], "x:", label="L2 model")
                a1.set_ylabel("GB (fwd+bwd)")
                a1.legend(fontsize=8)
                a2.plot(ds, [sum(r.get("ms") or 0 for r in total[d]) for d in ds], "o-")
                a2.set_ylabel("kernel ms (fwd+bwd)")
                for a in (a1, a2):
                    a.set_xlabel("fraction of nonzero blocks")
                sub.suptitle("Figure 2 right: block-sparse flashtile")
        written.append(out_dir / "fig2.png")
        fig.savefig(written[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)

    fig3 = [r for r in records if r.get("sweep") == "fig3" and not r.get("error")]
    if fig3:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
        for impl in FIG3_IMPLS:
            sel = sorted((r for r in fig3 if r["impl"] == impl), key=lambda r: r["n"])
            if not sel:
                continue
            a1.plot([r["n"] for r in sel], [r["ms"] for r in sel], "o-", label=impl)
            a2.plot([r["n"] for r in sel], [r["peak_extra_bytes"] / 1e9 for r in sel], "o-", label=impl)
        for a, label in ((a1, "fwd+bwd ms"), (a2, "peak extra memory GB")):
            a.set_xscale("log", base=2)
            a.set_yscale("log")
            a.set_xlabel("sequence length N (batch x N = 16K)")
            a.set_ylabel(label)
        a1.legend(fontsize=7)
        fig.suptitle("Figure 3: d=64, 16 heads, bf16")
        fig.tight_layout()
        written.append(out_dir / "fig3.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench io",
        description="DRAM / L2 bytes and time of attention kernels under Nsight Compute, "
                    "against flashtile's IO model (GPU; see docs/io.md).")
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the sweeps (the default command)")
    for q in (p, run):
        q.add_argument("--sweeps", nargs="+", choices=SWEEPS, default=list(SWEEPS))
        q.add_argument("--quick", action="store_true", help="fewer tile sizes, densities, N")
        q.add_argument("--out", default=None, metavar="FILE",
                       help=f"results JSON; the records go to its '{KEY}' entry (default: "
                            f"{RESULTS_DIR}/<device>.json)")
        q.add_argument("--plots", default=str(RESULTS_DIR),
                       help="directory for fig2.png and fig3.png (default %(default)s)")
        q.add_argument("--ncu", default=None, help="ncu executable (default: from PATH)")
        q.add_argument("--nvtx", action="store_true", help="profile only the NVTX range around "
                       "the measured calls (misses backward kernels, which run on the autograd "
                       "thread)")
        q.add_argument("--timeout", type=int, default=900, help="seconds per subprocess")
    rep = sub.add_parser("report", help="tables (and PNGs) from a results file")
    rep.add_argument("json", nargs="?", default=None,
                     help=f"results file (default: the first {RESULTS_DIR}/*.json with an "
                          f"'{KEY}' entry), or a JSON list of io records")
    rep.add_argument("--plots", default=str(RESULTS_DIR),
                     help="directory for fig2.png and fig3.png (default %(default)s)")
    rep.add_argument("--doc", default=None, help="markdown file whose results section to "
                     "replace (between the io-results markers), e.g. docs/io.md")
    w = sub.add_parser("worker", help="internal: the measured calls (run under ncu)")
    w.add_argument("--plan", required=True)
    w.add_argument("--log", required=True)
    w.add_argument("--device", default="cuda")
    f = sub.add_parser("fig3-worker", help="internal: the Figure 3 timings")
    f.add_argument("--out", required=True)
    f.add_argument("--quick", action="store_true")
    return p


def _report(records: list[dict], plots: str | None, doc: str | None) -> str:
    md = render_markdown(records)
    if plots:
        for path in plot(records, Path(plots)):
            print("wrote", path)
    if doc:
        update_doc(Path(doc), md)
        print("updated", doc)
    return md


def load_io_records(path: str | Path | None) -> tuple[Path, list[dict]]:
    """The io records of a results file (entry ``io``) or of a JSON list; without ``path``,
    of the first results file in ``benchmarks/results`` that has them."""
    candidates = [Path(path)] if path else sorted(RESULTS_DIR.glob("*.json"))
    for candidate in candidates:
        data = json.loads(candidate.read_text())
        records = data if isinstance(data, list) else data.get(KEY)
        if records is not None or path:
            return candidate, list(records or [])
    raise SystemExit(f"no results file in {RESULTS_DIR} has an '{KEY}' entry; pass one")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        run_worker(args.plan, args.log, args.device)
        return 0
    if args.command == "fig3-worker":
        run_fig3_worker(args.quick, args.out)
        return 0
    if args.command == "report":
        _, records = load_io_records(args.json)
        print(_report(records, args.plots, args.doc))
        return 0
    out = results_path("cuda", args.out)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="flashtile-io-") as tmp:
        cases = build_cases(args.sweeps, args.quick)
        if cases:
            ncu = args.ncu or shutil.which("ncu")
            if ncu is None:
                print("ncu (Nsight Compute) not found: pass --ncu PATH", file=sys.stderr)
                return 2
            for mode in sorted({CACHE_CONTROL.get(c.sweep, "all") for c in cases}):
                group = [c for c in cases if CACHE_CONTROL.get(c.sweep, "all") == mode]
                work = Path(tmp) / f"cache-{mode}"
                work.mkdir()
                records += run_ncu_sweeps(group, ncu, args.nvtx, work, args.timeout, mode)
        if "fig3" in args.sweeps:
            records += run_fig3(args.quick, Path(tmp), args.timeout)
    # keep the records of the sweeps not run now
    update_result(out, KEY, lambda old: [r for r in (old or []) if r.get("sweep") not in
                                         args.sweeps] + records)
    print(f"wrote {out} [{KEY}]")
    print(_report(read_results(out)[KEY], args.plots, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
