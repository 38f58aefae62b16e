"""Benchmark harness: flashtile against PyTorch's attention kernels on the same inputs.

Run it as ``python -m flashtile.bench [speed|memory|report|decode|variants] ...`` (``speed`` is
the default; ``decode`` and ``variants`` live in ``flashtile.bench_decode`` and
``flashtile.bench_variants``)::

    python -m flashtile.bench --quick                      # small preset, a minute or two on a GPU
    python -m flashtile.bench --mode fwd_bwd --d 128 --merge-into benchmarks/results/h100.json
    python -m flashtile.bench memory                       # peak memory of fwd+bwd against N
    python -m flashtile.bench report benchmarks/results/h100.json --out plots/
    python -m flashtile.bench variants --sweeps sparse window   # block-sparse density, windows

Implementations (``IMPLS``) and modes (``MODES``) are registries: adding one is a function plus a
dict entry.  An implementation's ``prepare`` turns the shared ``(B, N, H, d)`` inputs into a
``Prepared`` (a zero-argument forward, its leaf tensors, the upstream gradient in the same
layout); a mode's ``build`` turns a ``Prepared`` into the callable that is timed, doing any
untimed setup itself (``bwd`` runs the forward once there and times only the backward).

On CUDA the timer is ``triton.testing.do_bench(..., return_mode="median")``; on CPU it is the
median of ``time.perf_counter`` intervals.  See ``benchmarks/README.md`` for the output format.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import re
import statistics
import sys
import time
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "Case", "Config", "IMPLS", "Impl", "Inputs", "MODES", "Mode", "Prepared", "RECORD_KEYS",
    "build_plan", "cpu_bench", "fill_record", "flops", "main", "make_inputs", "make_timer",
    "measure_device_ceilings",
    "measure_peak", "merge_json", "parse_args", "plot", "plot_memory", "render_memory_table",
    "render_table", "run_case", "run_memory", "run_speed", "time_call", "write_json",
]

RECORD_KEYS = ("impl", "mode", "causal", "dtype", "d", "n", "batch", "heads", "tflops", "ms",
               "status", "device", "torch", "triton", "date", "error", "peak_bytes")
STATUSES = ("ok", "oom", "unsupported", "error")
MEMORY_MODE = "memory"
MAX_SEQLEN_MODE = "max_seqlen"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                  "half": "fp16", "fp32": "fp32", "float32": "fp32", "float": "fp32"}


# --------------------------------------------------------------------------------------------
# FLOPs, inputs
# --------------------------------------------------------------------------------------------

def flops(batch: int, heads: int, n: int, d: int, causal: bool, mode: str = "fwd") -> int:
    """FlashAttention-convention FLOPs of one call.

    Forward: ``4 * B * H * N^2 * d`` (two matmuls of ``2 * N^2 * d`` each), halved when causal.
    Backward is 2.5x the forward, forward+backward 3.5x (``MODES[mode].flops_mult``).
    """
    if MODES[mode].flops_fn is not None:
        return int(MODES[mode].flops_fn(batch, heads, n, d, causal))
    fwd = 4 * batch * heads * n * n * d
    if causal:
        fwd //= 2
    total = fwd * MODES[mode].flops_mult
    if total.denominator != 1:
        raise AssertionError(f"non-integral FLOP count {total}")
    return int(total)


def tflops_of(flop_count: int, ms: float) -> float:
    return flop_count / (ms * 1e-3) / 1e12


@dataclasses.dataclass
class Inputs:
    """Shared inputs in flashtile's layout ``(batch, seqlen, nheads, headdim)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def n(self) -> int:
        return self.q.shape[1]

    @property
    def heads(self) -> int:
        return self.q.shape[2]

    @property
    def d(self) -> int:
        return self.q.shape[3]

    @property
    def device(self) -> torch.device:
        return self.q.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.dout))


def make_inputs(batch: int, n: int, heads: int, d: int, dtype: str | torch.dtype,
                device: str | torch.device, seed: int = 0) -> Inputs:
    """Fresh ``torch.randn`` q, k, v and upstream gradient, ``(batch, n, heads, d)``, no grad."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    torch.manual_seed(seed)
    shape = (batch, n, heads, d)
    q, k, v, dout = (torch.randn(shape, dtype=dt, device=device) for _ in range(4))
    return Inputs(q, k, v, dout)


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Prepared:
    """What a mode needs: ``fn()`` runs the forward on ``leaves``; ``dout`` matches its output."""

    fn: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, ...]
    dout: torch.Tensor


def _null_context(device: torch.device) -> ContextManager:
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class Impl:
    """``prepare(inputs, causal, scale) -> Prepared``; ``context(device)`` wraps setup and timing.

    ``peer`` marks the implementations flashtile is compared against: a peer's exceptions are
    recorded as "unsupported" unless they are out-of-memory or a broken CUDA context
    (``classify_error``).
    """

    prepare: Callable[[Inputs, bool, float], Prepared]
    context: Callable[[torch.device], ContextManager] = _null_context
    peer: bool = True
    description: str = ""


def _flashtile():
    import flashtile

    if not hasattr(flashtile, "flash_attn_func"):
        raise ImportError("flashtile.flash_attn_func is not available")
    return flashtile


def _flashtile_use_backend():
    ft = _flashtile()
    use_backend = getattr(ft, "use_backend", None)
    if use_backend is None:
        from flashtile.backends import use_backend
    return use_backend


def _flashtile_context(device: torch.device) -> ContextManager:
    return _flashtile_use_backend()("triton" if device.type == "cuda" else "torch")


def _prepare_flashtile(inp: Inputs, causal: bool, scale: float) -> Prepared:
    ft = _flashtile()
    q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))

    def fn():
        out = ft.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return Prepared(fn, (q, k, v), inp.dout)


def _bhnd(t: torch.Tensor) -> torch.Tensor:
    """``(B, N, H, d)`` -> contiguous ``(B, H, N, d)`` copy of the same values."""
    return t.detach().transpose(1, 2).contiguous()


def _prepare_sdpa(inp: Inputs, causal: bool, scale: float) -> Prepared:
    q, k, v = (_bhnd(t).requires_grad_() for t in (inp.q, inp.k, inp.v))

    def fn():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    return Prepared(fn, (q, k, v), _bhnd(inp.dout))


def _sdpa_context(backend_name: str) -> Callable[[torch.device], ContextManager]:
    def context(device: torch.device) -> ContextManager:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, backend_name)])

    return context


_FLEX: dict[str, Any] = {"key": None, "fn": None, "block_mask": None}


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex_compiled(key: tuple, causal: bool, n: int, device: torch.device):
    """The compiled flex_attention and block mask for one shape set, compiled once per set.

    Moving to a new shape set resets dynamo, so every set compiles statically from scratch and
    the recompile limit is never reached.
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX["key"] != key:
        _FLEX.update(key=None, fn=None, block_mask=None)
        torch._dynamo.reset()
        block_mask = (create_block_mask(_causal_mask_mod, None, None, n, n, device=device)
                      if causal else None)
        _FLEX.update(key=key, fn=torch.compile(flex_attention, dynamic=False),
                     block_mask=block_mask)
    return _FLEX["fn"], _FLEX["block_mask"]


def _prepare_flex(inp: Inputs, causal: bool, scale: float) -> Prepared:
    key = (inp.batch, inp.n, inp.heads, inp.d, inp.q.dtype, str(inp.device), causal)
    compiled, block_mask = _flex_compiled(key, causal, inp.n, inp.device)
    q, k, v = (_bhnd(t).requires_grad_() for t in (inp.q, inp.k, inp.v))

    def fn():
        return compiled(q, k, v, block_mask=block_mask, scale=scale)

    return Prepared(fn, (q, k, v), _bhnd(inp.dout))


def _flex_context(device: torch.device) -> ContextManager:
    # the bwd mode backpropagates through one graph repeatedly (retain_graph=True), which
    # AOTAutograd forbids when the backward donates saved buffers
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "donated_buffer"):
        return functorch_config.patch(donated_buffer=False)
    return contextlib.nullcontext()


def reset_flex_cache() -> None:
    _FLEX.update(key=None, fn=None, block_mask=None)


IMPLS: dict[str, Impl] = {
    "flashtile": Impl(_prepare_flashtile, _flashtile_context, peer=False,
                      description="flashtile.flash_attn_func (triton on CUDA, torch on CPU)"),
    "sdpa": Impl(_prepare_sdpa, description="SDPA with PyTorch's default backend choice"),
    "sdpa_flash": Impl(_prepare_sdpa, _sdpa_context("FLASH_ATTENTION"),
                       description="SDPA, SDPBackend.FLASH_ATTENTION (FlashAttention-2)"),
    "sdpa_cudnn": Impl(_prepare_sdpa, _sdpa_context("CUDNN_ATTENTION"),
                       description="SDPA, SDPBackend.CUDNN_ATTENTION"),
    "sdpa_efficient": Impl(_prepare_sdpa, _sdpa_context("EFFICIENT_ATTENTION"),
                           description="SDPA, SDPBackend.EFFICIENT_ATTENTION (xformers kernel)"),
    "sdpa_math": Impl(_prepare_sdpa, _sdpa_context("MATH"),
                      description="SDPA, SDPBackend.MATH (standard attention, N x N scores)"),
    "flex": Impl(_prepare_flex, _flex_context,
                 description="torch.compile(flex_attention), create_block_mask when causal"),
}


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------

def _build_fwd(prep: Prepared) -> Callable[[], Any]:
    return prep.fn


def _build_bwd(prep: Prepared) -> Callable[[], Any]:
    out = prep.fn()  # untimed: the graph is kept and only the backward is timed
    leaves, dout = prep.leaves, prep.dout

    def backward():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return backward


def _build_fwd_bwd(prep: Prepared) -> Callable[[], Any]:
    fn, leaves, dout = prep.fn, prep.leaves, prep.dout

    def forward_backward():
        return torch.autograd.grad(fn(), leaves, dout)

    return forward_backward


@dataclasses.dataclass(frozen=True)
class Mode:
    """``build(prepared) -> timed callable``; its FLOPs are ``flops_mult`` x the forward's.

    Optional hooks for modes whose shapes differ from the shared inputs': ``inputs_fn`` maps the
    shared ``Inputs`` to the ones this mode's impls receive (e.g. only the last query), and
    ``flops_fn(batch, heads, n, d, causal)`` replaces the FLOP formula.
    """

    build: Callable[[Prepared], Callable[[], Any]]
    flops_mult: Fraction = Fraction(1)
    description: str = ""
    inputs_fn: Callable[[Inputs], Inputs] | None = None
    flops_fn: Callable[[int, int, int, int, bool], int] | None = None


MODES: dict[str, Mode] = {
    "fwd": Mode(_build_fwd, Fraction(1), "forward (inputs require grad, as in training)"),
    "bwd": Mode(_build_bwd, Fraction(5, 2), "backward alone: autograd.grad on a kept graph"),
    "fwd_bwd": Mode(_build_fwd_bwd, Fraction(7, 2), "forward then autograd.grad"),
}


# --------------------------------------------------------------------------------------------
# Timers
# --------------------------------------------------------------------------------------------

def cpu_bench(fn: Callable[[], Any], warmup: float = 0.0, rep: float = 50.0, min_reps: int = 3,
              max_reps: int = 1000, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median milliseconds of ``fn()`` by ``clock``: calls for ``warmup`` ms, then timed calls for
    ``rep`` ms (at least ``min_reps``, at most ``max_reps``)."""
    end = clock() + warmup * 1e-3
    while clock() < end:
        fn()
    times: list[float] = []
    end = clock() + rep * 1e-3
    while len(times) < min_reps or (len(times) < max_reps and clock() < end):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def make_timer(device: torch.device | str, warmup: float,
               rep: float) -> Callable[[Callable], float]:
    """``timer(fn) -> median ms``: ``triton.testing.do_bench`` on CUDA, ``cpu_bench`` on CPU."""
    if torch.device(device).type == "cuda":
        def cuda_timer(fn):
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        return cuda_timer

    def cpu_timer(fn):
        return cpu_bench(fn, warmup=warmup, rep=rep)
    return cpu_timer


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Cases and records
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    impl: str
    mode: str
    causal: bool
    dtype: str
    d: int
    n: int
    batch: int
    heads: int

    @property
    def shape_key(self) -> tuple:
        return (self.dtype, self.d, self.n, self.batch, self.heads)

    def flops(self) -> int:
        return flops(self.batch, self.heads, self.n, self.d, self.causal, self.mode)

    def label(self) -> str:
        return (f"{self.impl} {self.mode} {'causal' if self.causal else 'full'} {self.dtype} "
                f"d={self.d} n={self.n}")


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def runtime_env(device: torch.device | str) -> dict[str, Any]:
    """``device``, ``torch``, ``triton`` fields shared by every record of a run."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": name, "torch": torch.__version__, "triton": triton_version}


def make_record(env: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return fill_record(RECORD_KEYS, env, fields)


def fill_record(keys: Sequence[str], env: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A record with exactly ``keys`` (in that order): ``env``, then ``fields``, then the date;
    unset keys are None, unknown ones a KeyError."""
    rec = dict.fromkeys(keys)
    rec.update(env)
    rec.update(fields)
    rec["date"] = _utc_now()
    unknown = set(rec) - set(keys)
    if unknown:
        raise KeyError(f"unknown record fields {sorted(unknown)}")
    return rec


def first_line(exc: BaseException, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    msg = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


# CUDA errors after which the context is unusable: every later case would fail too
_FATAL_MARKERS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                  "misaligned address", "illegal instruction", "uncorrectable ecc")


def is_fatal(message: str | None) -> bool:
    return message is not None and any(m in message.lower() for m in _FATAL_MARKERS)


def classify_error(exc: BaseException, peer: bool) -> str:
    """"oom" for out-of-memory; "error" for a broken CUDA context or anything unexpected that
    flashtile raises; "unsupported" for the rest (peers' refusals, flashtile's
    NotImplementedError/ValueError)."""
    if is_fatal(str(exc)):
        return "error"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    if peer or isinstance(exc, (NotImplementedError, ValueError)):
        return "unsupported"
    return "error"


def _warning_text(caught: list, limit: int = 200) -> str:
    msgs = []
    for w in caught:
        if issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning)):
            continue
        text = " ".join(str(w.message).split())
        text = text if len(text) <= limit else text[: limit - 3] + "..."
        if text and text not in msgs:
            msgs.append(text)
    return "; ".join(msgs)


def _case_fields(case: Case) -> dict[str, Any]:
    return dict(impl=case.impl, mode=case.mode, causal=case.causal, dtype=case.dtype, d=case.d,
                n=case.n, batch=case.batch, heads=case.heads)


def run_case(case: Case, inputs: Inputs, timer: Callable[[Callable], float],
             env: dict[str, Any], raise_errors: bool = False) -> dict[str, Any]:
    """Time one case on ``inputs`` and return its record; never raises for a failing case
    unless ``raise_errors``. A failed case's ``error`` is the exception's first line, followed by
    the warnings raised meanwhile (SDPA explains there why a backend refused the inputs)."""
    impl, mode = IMPLS[case.impl], MODES[case.mode]
    device = inputs.device

    def prepare() -> Prepared:
        mode_inputs = inputs if mode.inputs_fn is None else mode.inputs_fn(inputs)
        return impl.prepare(mode_inputs, case.causal, case.d ** -0.5)

    status, error, ms = time_call(prepare, case.mode, device, timer, lambda: impl.context(device),
                                  impl.peer, raise_errors)
    tflops = tflops_of(case.flops(), ms) if status == "ok" else None
    return make_record(env, **_case_fields(case), tflops=tflops, ms=ms, status=status,
                       error=error)


def time_call(prepare: Callable[[], Prepared], mode: str, device: torch.device,
              timer: Callable[[Callable], float], context: Callable[[], ContextManager],
              peer: bool, raise_errors: bool = False) -> tuple[str, str | None, float | None]:
    """``(status, error, ms)`` of ``MODES[mode].build(prepare())`` under ``context()``.

    One untimed call first (compilation, autotuning, unsupported inputs), then ``timer``.
    Never raises unless ``raise_errors``: a failure's status comes from ``classify_error`` and
    its error is the exception's first line, followed by the warnings raised meanwhile (SDPA
    explains there why a backend refused the inputs)."""
    status, error, ms = "ok", None, None
    prep = fn = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with context():
                prep = prepare()
                fn = MODES[mode].build(prep)
                fn()
                _synchronize(device)
                ms = timer(fn)
                _synchronize(device)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a record
            if raise_errors:
                raise
            status, error, ms = classify_error(exc, peer), first_line(exc), None
            extra = _warning_text(caught)
            if extra:
                error = f"{error} [warnings: {extra}]"
    prep = fn = None
    if status != "ok":
        gc.collect()
    _empty_cache(device)
    return status, error, ms


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Preset:
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


_GPU_IMPLS = ("flashtile", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "flex")
_CPU_IMPLS = ("flashtile", "sdpa", "sdpa_math")
_ALL_MODES = ("fwd", "bwd", "fwd_bwd")

PRESETS: dict[tuple[str, bool], Preset] = {
    # the FlashAttention papers' sweep: 16K tokens per batch, hidden 2048
    ("cuda", False): Preset(_GPU_IMPLS, _ALL_MODES, (False, True), ("bf16", "fp16"), (64, 128, 256),
                            (512, 1024, 2048, 4096, 8192, 16384), 16384, 2048, 25, 100),
    ("cuda", True): Preset(_GPU_IMPLS, _ALL_MODES, (False, True), ("bf16",), (128,),
                           (1024, 4096), 16384, 2048, 10, 40),
    ("cpu", False): Preset(_CPU_IMPLS, _ALL_MODES, (False, True), ("fp32", "bf16"), (64,),
                           (256, 512, 1024, 2048), 2048, 128, 0, 20),
    ("cpu", True): Preset(_CPU_IMPLS, _ALL_MODES, (False, True), ("fp32",), (64,),
                          (256, 512), 1024, 128, 0, 5),
}


@dataclasses.dataclass(frozen=True)
class Config:
    device: str
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
    out: Path = Path("bench_out")
    merge_into: Path | None = None
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

    def batch_for(self, n: int) -> int:
        return self.batch if self.batch is not None else max(1, self.tokens // n)

    def heads_for(self, d: int) -> int:
        return self.heads if self.heads is not None else max(1, self.hidden // d)


def parse_seqlen(text: str) -> int:
    """``"512"`` -> 512, ``"1k"``/``"1K"`` -> 1024, ``"16K"`` -> 16384."""
    m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", str(text))
    if not m or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad sequence length {text!r} (e.g. 512, 1K, 16k)")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def parse_dtype(text: str) -> str:
    key = str(text).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(DTYPES)}")
    return _DTYPE_ALIASES[key]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _flatten(values: Iterable[str] | None, convert: Callable[[str], Any]) -> tuple | None:
    """``["64,128", "256"]`` -> ``(64, 128, 256)`` (order kept, duplicates dropped)."""
    if values is None:
        return None
    out: list = []
    for value in values:
        for part in str(value).split(","):
            if part.strip():
                item = convert(part.strip())
                if item not in out:
                    out.append(item)
    return tuple(out)


def _choice(allowed: Sequence[str], what: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text == "all":
            raise argparse.ArgumentTypeError("'all' must be given alone")
        if text not in allowed:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}; choose from {', '.join(allowed)} or all")
        return text
    return convert


def _names(values: list[str] | None, allowed: Sequence[str], what: str) -> tuple[str, ...] | None:
    if values is None:
        return None
    if [v.strip() for v in values] == ["all"]:
        return tuple(allowed)
    return _flatten(values, _choice(allowed, what))


def _causal_values(text: str | None) -> tuple[bool, ...] | None:
    return None if text is None else {"0": (False,), "1": (True,), "both": (False, True)}[text]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _common_arguments(p: argparse.ArgumentParser, outputs: str) -> None:
    p.add_argument("--out", type=Path, default=Path("bench_out"),
                   help=f"output directory for {outputs} (default: bench_out)")
    p.add_argument("--merge-into", type=Path, default=None, metavar="FILE",
                   help="also merge this run's records into FILE (a JSON list); a record "
                        "replaces an older one with the same "
                        "device/impl/mode/causal/dtype/d/n/batch/heads")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG plots")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raise-errors", action="store_true",
                   help="re-raise the first failing case instead of recording it (debugging)")


def speed_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench",
        description="Time flashtile against SDPA (flash, cuDNN, efficient, math) and "
                    "FlexAttention. "
                    "Subcommands: speed (default), memory, report, decode, variants; "
                    "'<subcommand> -h' for each. "
                    "Unset selections come from the preset for the device (--quick for the "
                    "small one).")
    p.add_argument("--impl", nargs="+", default=None, metavar="NAME",
                   help=f"implementations, or 'all' ({', '.join(IMPLS)}); "
                        f"default on CUDA: {' '.join(_GPU_IMPLS)}; on CPU: {' '.join(_CPU_IMPLS)}")
    p.add_argument("--mode", nargs="+", default=None, metavar="MODE",
                   help=f"modes, or 'all' ({', '.join(MODES)}); default all")
    p.add_argument("--causal", choices=("0", "1", "both"), default=None, help="default both")
    p.add_argument("--d", nargs="+", default=None, metavar="D", help="head dims, e.g. 64 128 256")
    p.add_argument("--n", nargs="+", default=None, metavar="N",
                   help="sequence lengths, e.g. 512 1K 16K")
    p.add_argument("--dtype", nargs="+", default=None, metavar="DTYPE",
                   help=f"dtypes ({', '.join(DTYPES)}); default bf16 fp16 on CUDA, "
                        "fp32 bf16 on CPU")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help="tokens per batch: batch = tokens // N "
                        "(default 16384 on CUDA, 2048 on CPU)")
    p.add_argument("--hidden", type=_positive_int, default=None,
                   help="model width: heads = hidden // d (default 2048 on CUDA, 128 on CPU)")
    p.add_argument("--batch", type=_positive_int, default=None,
                   help="fixed batch (overrides --tokens)")
    p.add_argument("--heads", type=_positive_int, default=None,
                   help="fixed heads (overrides --hidden)")
    p.add_argument("--quick", action="store_true", help="small preset for a fast check")
    p.add_argument("--warmup", type=float, default=None,
                   help="warm-up time in ms (do_bench's warmup; default 25 on CUDA)")
    p.add_argument("--rep", type=float, default=None,
                   help="measured time in ms (do_bench's rep; default 100 on CUDA)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no new shape after this many seconds (what ran is still written)")
    p.add_argument("--no-device-ceilings", dest="ceilings", action="store_false",
                   help="skip the copy-bandwidth and matmul measurement (device.json)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch.set_num_threads for the CPU path (default: torch's choice; 1 gives "
                        "steadier CPU timings on a busy machine)")
    p.add_argument("--resume", action="store_true",
                   help="skip the cases that the --merge-into file already holds with status ok, "
                        "oom or unsupported for this device (to continue a cut-off run)")
    _common_arguments(p, "results.json, device.json and the plots")
    return p


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse the speed benchmark's flags into a ``Config`` (unset selections from the preset)."""
    p = speed_parser()
    a = p.parse_args(argv)
    try:
        impls = _names(a.impl, list(IMPLS), "implementation")
        modes = _names(a.mode, list(MODES), "mode")
        ds = _flatten(a.d, _positive_int)
        ns = _flatten(a.n, parse_seqlen)
        dtypes = _flatten(a.dtype, parse_dtype)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if a.resume and a.merge_into is None:
        p.error("--resume needs --merge-into FILE")
    device = a.device or _default_device()
    preset = PRESETS[(device, bool(a.quick))]
    return Config(
        device=device,
        impls=impls or preset.impls,
        modes=modes or preset.modes,
        causal=_causal_values(a.causal) or preset.causal,
        dtypes=dtypes or preset.dtypes,
        ds=ds or preset.ds,
        ns=ns or preset.ns,
        tokens=a.tokens or preset.tokens,
        hidden=a.hidden or preset.hidden,
        warmup=preset.warmup if a.warmup is None else a.warmup,
        rep=preset.rep if a.rep is None else a.rep,
        out=a.out, merge_into=a.merge_into, batch=a.batch, heads=a.heads, seed=a.seed,
        plot=a.plot, progress=a.progress, time_limit=a.time_limit, raise_errors=a.raise_errors,
        ceilings=a.ceilings, resume=a.resume, threads=a.threads,
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
# Progress
# --------------------------------------------------------------------------------------------

class _Counter:
    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr

    def set_description(self, text: str) -> None:
        self.stream.write(f"[{self.done + 1}/{self.total}] {text}\n")
        self.stream.flush()

    def update(self, k: int = 1) -> None:
        self.done += k

    def write(self, text: str) -> None:
        self.stream.write(text + "\n")

    def close(self) -> None:
        pass


class _Silent(_Counter):
    def set_description(self, text: str) -> None:
        pass

    def write(self, text: str) -> None:
        pass


class _Tqdm:
    """tqdm bar on stderr; redrawn at most every 30 s when stderr is not a terminal."""

    def __init__(self, total: int, tqdm_cls):
        self._tqdm = tqdm_cls
        interactive = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        self.bar = tqdm_cls(total=total, file=sys.stderr, dynamic_ncols=True, unit="case",
                            mininterval=0.1 if interactive else 30.0)

    def set_description(self, text: str) -> None:
        self.bar.set_description(text, refresh=False)

    def update(self, k: int = 1) -> None:
        self.bar.update(k)

    def write(self, text: str) -> None:
        self._tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


def make_progress(total: int, enabled: bool = True):
    """A progress reporter on stderr: tqdm when importable, else ``[i/n] case`` lines."""
    if not enabled:
        return _Silent(total)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total)
    return _Tqdm(total, tqdm)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Output: JSON, table, plots
# --------------------------------------------------------------------------------------------

def write_json(path: Path | str, data: Any) -> Path:
    """Write ``data`` as JSON atomically (temporary file then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_records(path: Path | str) -> list[dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a JSON list of records")
    return data


def record_key(rec: dict[str, Any]) -> tuple:
    n = None if rec.get("mode") == MAX_SEQLEN_MODE else rec.get("n")
    return (rec.get("device"), rec.get("impl"), rec.get("mode"), rec.get("causal"),
            rec.get("dtype"), rec.get("d"), n, rec.get("batch"), rec.get("heads"))


def merge_records(old: list[dict], new: list[dict],
                  key: Callable[[dict], tuple] = record_key) -> list[dict]:
    """``old`` + ``new``; a new record takes the place of an old one with the same ``key``."""
    merged = {key(r): r for r in old}
    for r in new:
        merged[key(r)] = r
    return list(merged.values())


def merge_json(path: Path | str, records: list[dict],
               key: Callable[[dict], tuple] = record_key) -> Path:
    path = Path(path)
    old = load_records(path) if path.exists() else []
    return write_json(path, merge_records(old, records, key))


def format_n(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt_tflops(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


_STATUS_CELL = {"oom": "oom", "unsupported": "unsup", "error": "error"}


def _cell(rec: dict | None) -> str:
    if rec is None:
        return "-"
    if rec.get("status") == "ok" and rec.get("tflops") is not None:
        return _fmt_tflops(rec["tflops"])
    return _STATUS_CELL.get(rec.get("status"), str(rec.get("status")))


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.rjust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def _ordered(values: Iterable, preferred: Sequence) -> list:
    seen = list(dict.fromkeys(values))
    return [v for v in preferred if v in seen] + [v for v in seen if v not in preferred]


def _by_device(records: list[dict]) -> list[tuple[str, list[dict]]]:
    devices = list(dict.fromkeys(r.get("device") for r in records))
    return [(dev, [r for r in records if r.get("device") == dev]) for dev in devices]


def _sections(parts: list[tuple[str, str]]) -> str:
    if len(parts) == 1:
        return parts[0][1]
    return "\n\n".join(f"device: {dev}\n{text}" for dev, text in parts)


def render_table(records: list[dict], reference: str = "flashtile") -> str:
    """TFLOP/s per (mode, causal, dtype, d, n) row and impl column, plus ``ft/<peer>`` ratio
    columns (reference TFLOP/s over the peer's; "-" unless both ran). A later record for the
    same cell wins. Failed cells show "oom", "unsup" or "error"."""
    speed = [r for r in records if r.get("mode") not in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if not speed:
        return "(no speed records)"
    parts = []
    mode_order = {m: i for i, m in enumerate(MODES)}
    for dev, recs in _by_device(speed):
        impls = _ordered((r["impl"] for r in recs), list(IMPLS))
        peers = [i for i in impls if i != reference] if reference in impls else []
        cells: dict[tuple, dict] = {}
        for r in recs:
            key = (r["mode"], bool(r["causal"]), r["dtype"], r["d"], r["n"], r["batch"], r["heads"])
            cells[key + (r["impl"],)] = r
        keys = sorted({k[:-1] for k in cells},
                      key=lambda k: (mode_order.get(k[0], len(mode_order)), k[0], k[1], k[2],
                                     k[3], k[4], k[5], k[6]))
        header = ["mode", "causal", "dtype", "d", "n", "B", "H"] + impls
        header += [f"ft/{p}" for p in peers]
        rows = []
        for key in keys:
            mode, causal, dtype, d, n, batch, heads = key
            row = [mode, "1" if causal else "0", dtype, str(d), format_n(n), str(batch), str(heads)]
            row += [_cell(cells.get(key + (i,))) for i in impls]
            ref = cells.get(key + (reference,))
            for p in peers:
                peer = cells.get(key + (p,))
                ok = (ref is not None and peer is not None and ref.get("status") == "ok"
                      and peer.get("status") == "ok" and peer.get("tflops"))
                row.append(f"{ref['tflops'] / peer['tflops']:.2f}" if ok else "-")
            rows.append(row)
        parts.append((dev, _markdown(header, rows)))
    return _sections(parts)


def render_memory_table(records: list[dict]) -> str:
    """Peak extra memory (GiB) per sequence length and impl, and each impl's longest N."""
    mem = [r for r in records if r.get("mode") in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if not mem:
        return "(no memory records)"
    parts = []
    for dev, recs in _by_device(mem):
        impls = _ordered((r["impl"] for r in recs), list(IMPLS))
        cells = {(r["n"], r["impl"]): r for r in recs if r["mode"] == MEMORY_MODE}
        longest = {r["impl"]: r for r in recs if r["mode"] == MAX_SEQLEN_MODE}
        rows = []
        for n in sorted({n for n, _ in cells}):
            row = [format_n(n)]
            for impl in impls:
                r = cells.get((n, impl))
                if r is None:
                    row.append("-")
                elif r.get("status") == "ok" and r.get("peak_bytes") is not None:
                    row.append(f"{r['peak_bytes'] / 2**30:.3f}")
                else:
                    row.append(_STATUS_CELL.get(r.get("status"), str(r.get("status"))))
            rows.append(row)
        if longest:
            rows.append(["longest"] + [format_n(longest[i]["n"]) if i in longest else "-"
                                       for i in impls])
        parts.append((dev, _markdown(["n"] + [f"{i} GiB" for i in impls], rows)))
    return _sections(parts)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", str(text)).strip("_").lower() or "device"


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _log2_axis(ax, ns: list[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([format_n(n) for n in ns])
    ax.xaxis.set_minor_locator(NullLocator())


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _log("matplotlib is not installed: no plots (pip install matplotlib)")
        return False
    return True


def _shape_note(recs: list[dict]) -> list[str]:
    """"B*N=16384" / "H=16" when constant over ``recs``."""
    tokens = {r["batch"] * r["n"] for r in recs}
    heads = {r["heads"] for r in recs}
    notes = [f"B*N={tokens.pop()}"] if len(tokens) == 1 else []
    return notes + ([f"H={heads.pop()}"] if len(heads) == 1 else [])


def plot(records: list[dict], out_dir: Path | str) -> list[Path]:
    """One PNG per (mode, causal, dtype, d): TFLOP/s against N, one line per impl.

    File names are ``{mode}_{causal|full}_{dtype}_d{d}.png``, prefixed by the device when the
    records come from several devices."""
    speed = [r for r in records if r.get("mode") not in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if not speed or not _have_matplotlib():
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = _by_device(speed)
    paths = []
    for dev, recs in groups:
        keys = sorted({(r["mode"], bool(r["causal"]), r["dtype"], r["d"]) for r in recs},
                      key=lambda k: (list(MODES).index(k[0]) if k[0] in MODES else 99, k))
        for mode, causal, dtype, d in keys:
            sel = [r for r in recs if (r["mode"], bool(r["causal"]), r["dtype"], r["d"])
                   == (mode, causal, dtype, d)]
            fig, ax = _figure()
            for impl in _ordered((r["impl"] for r in sel), list(IMPLS)):
                pts = {r["n"]: r["tflops"] for r in sel
                       if r["impl"] == impl and r.get("status") == "ok" and r.get("tflops")}
                if pts:
                    ns = sorted(pts)
                    ax.plot(ns, [pts[n] for n in ns], marker="o", label=impl)
            _log2_axis(ax, sorted({r["n"] for r in sel}))
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small")
            shape = ", ".join(_shape_note(sel))
            ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}, {dtype}, d={d}"
                         f"{', ' + shape if shape else ''}\n{dev}", fontsize="medium")
            fig.tight_layout()
            name = f"{mode}_{'causal' if causal else 'full'}_{dtype}_d{d}.png"
            path = out_dir / (f"{_slug(dev)}_{name}" if len(groups) > 1 else name)
            fig.savefig(path, dpi=120)
            paths.append(path)
    return paths


def plot_memory(records: list[dict], out_dir: Path | str) -> list[Path]:
    """Peak extra memory of fwd+bwd against N, one line per impl, longest N in the legend."""
    mem = [r for r in records if r.get("mode") in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if not mem or not _have_matplotlib():
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = _by_device(mem)
    paths = []
    for dev, recs in groups:
        fig, ax = _figure()
        longest = {r["impl"]: r["n"] for r in recs if r["mode"] == MAX_SEQLEN_MODE}
        sweep = [r for r in recs if r["mode"] == MEMORY_MODE]
        for impl in _ordered((r["impl"] for r in sweep), list(IMPLS)):
            pts = {r["n"]: r["peak_bytes"] / 2**30 for r in sweep
                   if r["impl"] == impl and r.get("status") == "ok" and r.get("peak_bytes")}
            if pts:
                ns = sorted(pts)
                label = f"{impl} (longest {format_n(longest[impl])})" if impl in longest else impl
                ax.plot(ns, [pts[n] for n in ns], marker="o", label=label)
        if sweep:
            _log2_axis(ax, sorted({r["n"] for r in sweep}))
        if ax.lines:
            ax.set_yscale("log")
            ax.legend(fontsize="small")
        first = sweep[0] if sweep else recs[0]
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("peak extra memory, fwd+bwd (GiB)")
        ax.grid(alpha=0.3, which="both")
        ax.set_title(f"memory: B={first['batch']}, H={first['heads']}, d={first['d']}, "
                     f"{first['dtype']}\n{dev}", fontsize="medium")
        fig.tight_layout()
        path = out_dir / (f"{_slug(dev)}_memory.png" if len(groups) > 1 else "memory.png")
        fig.savefig(path, dpi=120)
        paths.append(path)
    return paths


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
    _synchronize(device)
    return timer(copy), src.numel() * src.element_size()


def _time_matmul(device: torch.device, timer: Callable[[Callable], float], n: int,
                 dtype: torch.dtype) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty_like(a)

    def matmul():
        return torch.mm(a, b, out=c)

    matmul()
    _synchronize(device)
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
    info["date"] = _utc_now()
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
    _empty_cache(device)
    return info


# --------------------------------------------------------------------------------------------
# Speed run
# --------------------------------------------------------------------------------------------

RESULTS_FILE = "results.json"
MEMORY_FILE = "memory.json"


def _write_results(cfg_out: Path, merge_into: Path | None, records: list[dict],
                   name: str = RESULTS_FILE, key: Callable[[dict], tuple] = record_key) -> None:
    write_json(cfg_out / name, records)
    if merge_into is not None:
        merge_json(merge_into, records, key)


def case_key(case: Case, device_name: str) -> tuple:
    """``record_key`` of the record ``case`` produces on device ``device_name``."""
    return (device_name, case.impl, case.mode, case.causal, case.dtype, case.d, case.n,
            case.batch, case.heads)


def _done_records(cfg: Config, device_name: str) -> dict[tuple, dict]:
    """Records of the --merge-into file that --resume does not run again."""
    if not cfg.resume or cfg.merge_into is None or not Path(cfg.merge_into).exists():
        return {}
    return {record_key(r): r for r in load_records(cfg.merge_into)
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
    """Run every case of ``cfg``; writes results.json after each shape, then the table (stdout),
    device.json and the plots. Returns this run's records.

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
    full_plan = build_plan(cfg)
    done = _done_records(cfg, env["device"])
    plan = [c for c in full_plan if case_key(c, env["device"]) not in done]
    if done:
        _log(f"--resume: {len(full_plan) - len(plan)} of {len(full_plan)} cases already in "
             f"{cfg.merge_into}")
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
                inputs = make_inputs(c0.batch, c0.n, c0.heads, c0.d, c0.dtype, device, cfg.seed)
                input_failure = None
            except Exception as exc:  # noqa: BLE001 - recorded for every case of the shape
                if cfg.raise_errors:
                    raise
                inputs, input_failure = None, (classify_error(exc, True), first_line(exc))
            for case in group:
                progress.set_description(case.label())
                if input_failure is None:
                    rec = run_case(case, inputs, timer, env, cfg.raise_errors)
                else:
                    rec = make_record(env, **_case_fields(case), status=input_failure[0],
                                      error=f"making the inputs: {input_failure[1]}")
                if rec["status"] == "error":
                    progress.write(f"error: {case.label()}: {rec['error']}")
                records.append(rec)
                progress.update(1)
                if is_fatal(rec["error"]):
                    stop_reason = f"unrecoverable CUDA error in {case.label()}"
                    break
            del inputs
            reset_flex_cache()
            gc.collect()
            _empty_cache(device)
            _write_results(cfg.out, cfg.merge_into, records)
    finally:
        progress.close()
        reset_flex_cache()
    if stop_reason is not None:
        _log(f"{stop_reason}: ran {len(records)} of {len(plan)} cases")
    _write_results(cfg.out, cfg.merge_into, records)
    if cfg.ceilings and not (stop_reason or "").startswith("unrecoverable"):
        try:
            ceilings = measure_device_ceilings(device, timer)
            write_json(cfg.out / "device.json", ceilings)
            _log(f"device: copy {ceilings['copy_bandwidth_GBps']:.0f} GB/s, "
                 f"{ceilings['matmul_dtype']} matmul {ceilings['matmul_tflops']:.3g} TFLOP/s")
        except Exception as exc:  # noqa: BLE001 - ceilings are informative only
            _log(f"device ceilings not measured: {first_line(exc)}")
    shown = [done[k] for k in (case_key(c, env["device"]) for c in full_plan) if k in done]
    shown += records
    print(render_table(shown), file=stdout)
    written = [cfg.out / "results.json"]
    if cfg.plot:
        written += plot(shown, cfg.out)
    if cfg.merge_into is not None:
        written.append(cfg.merge_into)
    _log("wrote " + ", ".join(str(p) for p in written))
    return records


# --------------------------------------------------------------------------------------------
# Memory run
# --------------------------------------------------------------------------------------------

class CudaMemory:
    """The allocator statistics the memory benchmark reads (replaceable in tests)."""

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def measure_peak(impl_name: str, inputs: Inputs, causal: bool, mem) -> int:
    """Peak bytes allocated by one forward+backward beyond what was allocated before it (the
    inputs). A first, unmeasured step absorbs compilation and autotuning."""
    impl = IMPLS[impl_name]
    with impl.context(inputs.device):
        prep = impl.prepare(inputs, causal, inputs.d ** -0.5)
        step = MODES["fwd_bwd"].build(prep)
        step()
        mem.synchronize()
        mem.reset_peak()
        base = mem.allocated()
        step()
        mem.synchronize()
        return mem.peak() - base


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    device: str
    impls: tuple[str, ...] = ("flashtile", "sdpa_flash", "sdpa_math")
    n_min: int = 1024
    n_max: int = 256 * 1024
    batch: int = 1
    heads: int = 16
    d: int = 128
    dtype: str = "bf16"
    causal: bool = False
    out: Path = Path("bench_out")
    merge_into: Path | None = None
    seed: int = 0
    plot: bool = True
    progress: bool = True
    raise_errors: bool = False

    def seqlens(self) -> list[int]:
        ns, n = [], self.n_min
        while n <= self.n_max:
            ns.append(n)
            n *= 2
        return ns


def run_memory(cfg: MemoryConfig, mem=None, stdout=None) -> list[dict]:
    """Peak extra memory of fwd+bwd for N = n_min, 2 n_min, ... up to n_max. An impl stops at
    its first failure; a ``max_seqlen`` record per impl gives the longest N that ran (its
    ``error`` says what stopped the probe, None when it reached n_max). Records go to
    ``OUT/memory.json`` (and --merge-into), the plot to ``OUT/memory.png``."""
    stdout = stdout or sys.stdout
    device = torch.device(cfg.device)
    mem = mem or CudaMemory()
    env = runtime_env(device)
    ns = cfg.seqlens()
    progress = make_progress(len(ns) * len(cfg.impls), cfg.progress)
    records: list[dict] = []
    longest: dict[str, dict] = {}
    stopped: dict[str, str] = {}
    base = dict(mode=MEMORY_MODE, causal=cfg.causal, dtype=cfg.dtype, d=cfg.d,
                batch=cfg.batch, heads=cfg.heads)
    try:
        for n in ns:
            active = [i for i in cfg.impls if i not in stopped]
            if not active:
                break
            try:
                inputs = make_inputs(cfg.batch, n, cfg.heads, cfg.d, cfg.dtype, device, cfg.seed)
                input_failure = None
            except Exception as exc:  # noqa: BLE001 - recorded for every impl
                if cfg.raise_errors:
                    raise
                inputs = None
                input_failure = (classify_error(exc, True),
                                 f"making the inputs: {first_line(exc)}")
            for impl in active:
                progress.set_description(f"memory {impl} n={n}")
                status, error, peak = "ok", None, None
                if input_failure is not None:
                    status, error = input_failure
                else:
                    try:
                        peak = measure_peak(impl, inputs, cfg.causal, mem)
                    except Exception as exc:  # noqa: BLE001
                        if cfg.raise_errors:
                            raise
                        status, error = classify_error(exc, IMPLS[impl].peer), first_line(exc)
                gc.collect()
                mem.empty_cache()
                rec = make_record(env, impl=impl, n=n, status=status, error=error,
                                  peak_bytes=peak, **base)
                records.append(rec)
                if status == "ok":
                    longest[impl] = rec
                else:
                    stopped[impl] = f"{status} at n={n}: {error}"
                progress.update(1)
                if is_fatal(error):
                    _log(f"unrecoverable CUDA error ({impl}, n={n}): stopping the sweep")
                    stopped.update({i: f"not run after the CUDA error at n={n}"
                                    for i in cfg.impls if i not in stopped})
                    break
            del inputs
            gc.collect()
            mem.empty_cache()
            _write_results(cfg.out, cfg.merge_into, records, MEMORY_FILE)
    finally:
        progress.close()
    for impl in cfg.impls:
        best = longest.get(impl)
        records.append(make_record(
            env, impl=impl, n=best["n"] if best else None,
            status="ok" if best else records_status(records, impl),
            error=stopped.get(impl), peak_bytes=best["peak_bytes"] if best else None,
            **{**base, "mode": MAX_SEQLEN_MODE}))
    _write_results(cfg.out, cfg.merge_into, records, MEMORY_FILE)
    print(render_memory_table(records), file=stdout)
    written = [cfg.out / MEMORY_FILE]
    if cfg.plot:
        written += plot_memory(records, cfg.out)
    if cfg.merge_into is not None:
        written.append(cfg.merge_into)
    _log("wrote " + ", ".join(str(p) for p in written))
    return records


def records_status(records: list[dict], impl: str) -> str:
    """Status of ``impl``'s last memory record ("error" when it never ran)."""
    statuses = [r["status"] for r in records if r["impl"] == impl and r["mode"] == MEMORY_MODE]
    return statuses[-1] if statuses else "error"


def memory_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench memory",
        description="Peak extra CUDA memory of forward+backward against sequence length "
                    "(doubling from --n-min to --n-max), and the longest N each impl runs.")
    p.add_argument("--impl", nargs="+", default=None, metavar="NAME",
                   help=f"default flashtile sdpa_flash sdpa_math; any of {', '.join(IMPLS)}")
    p.add_argument("--n-min", type=parse_seqlen, default=1024, help="first N (default 1K)")
    p.add_argument("--n-max", type=parse_seqlen, default=256 * 1024,
                   help="last N of the doubling sweep (default 256K)")
    p.add_argument("--batch", type=_positive_int, default=1, help="default 1")
    p.add_argument("--heads", type=_positive_int, default=16, help="default 16")
    p.add_argument("--d", type=_positive_int, default=128, help="head dim (default 128)")
    p.add_argument("--dtype", type=parse_dtype, default="bf16", help="default bf16")
    p.add_argument("--causal", choices=("0", "1"), default="0", help="default 0")
    _common_arguments(p, "memory.json and memory.png")
    return p


def parse_memory_args(argv: Sequence[str] | None = None) -> MemoryConfig:
    p = memory_parser()
    a = p.parse_args(argv)
    try:
        impls = _names(a.impl, list(IMPLS), "implementation")
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if a.n_min > a.n_max:
        p.error("--n-min is larger than --n-max")
    return MemoryConfig(
        device=a.device or _default_device(), impls=impls or MemoryConfig.impls,
        n_min=a.n_min, n_max=a.n_max, batch=a.batch, heads=a.heads, d=a.d, dtype=a.dtype,
        causal=a.causal == "1", out=a.out, merge_into=a.merge_into, seed=a.seed, plot=a.plot,
        progress=a.progress, raise_errors=a.raise_errors)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashtile.bench report",
        description="Print the tables and draw the plots of saved results (JSON lists of records).")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None, help="write plots here (default: no plots)")
    p.add_argument("--device", default=None,
                   help="keep only records whose device name contains this text")
    return p


def run_report(argv: Sequence[str], stdout=None) -> int:
    stdout = stdout or sys.stdout
    a = report_parser().parse_args(argv)
    from . import bench_variants

    records: list[dict] = []
    variants: list[dict] = []
    for path in a.files:
        loaded = load_records(path)
        foreign = [r for r in loaded if "impl" not in r or "mode" not in r]
        if foreign:
            _log(f"{path}: skipped {len(foreign)} records without impl/mode (another format)")
            loaded = [r for r in loaded if "impl" in r and "mode" in r]
        records = merge_records(records, [r for r in loaded if "variant" not in r])
        variants = merge_records(variants, [r for r in loaded if "variant" in r],
                                 bench_variants.variant_key)
    if a.device:
        def keep(r):
            return a.device.lower() in str(r.get("device", "")).lower()
        records, variants = [r for r in records if keep(r)], [r for r in variants if keep(r)]
    speed = [r for r in records if r.get("mode") not in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    memory = [r for r in records if r.get("mode") in (MEMORY_MODE, MAX_SEQLEN_MODE)]
    if speed or not (memory or variants):
        print(render_table(speed), file=stdout)
    if memory:
        print(render_memory_table(memory), file=stdout)
    if variants:
        print(bench_variants.render_table(variants), file=stdout)
    if a.out is not None:
        paths = plot(speed, a.out) + plot_memory(memory, a.out)
        paths += bench_variants.plot(variants, a.out) if variants else []
        _log("wrote " + (", ".join(map(str, paths)) or "no plots"))
    return 0


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

SUBCOMMANDS = ("speed", "memory", "report", "decode", "variants")


def main(argv: Sequence[str] | None = None) -> int:
    """``[speed] FLAGS`` | ``memory FLAGS`` | ``report FILES`` | ``decode FLAGS`` (the KV-cache
    decode benchmark, ``flashtile.bench_decode``) | ``variants FLAGS`` (block-sparse density,
    sliding-window and varlen sweeps, ``flashtile.bench_variants``). Exit status 1 when a
    flashtile case failed with an unexpected error, 2 for usage problems."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "speed"
    if sub == "decode":
        from . import bench_decode
        return bench_decode.main(argv)
    if sub == "variants":
        from . import bench_variants
        return bench_variants.main(argv)
    if sub == "report":
        return run_report(argv)
    if sub == "memory":
        mcfg = parse_memory_args(argv)
        if torch.device(mcfg.device).type != "cuda" or not torch.cuda.is_available():
            _log("the memory benchmark reads CUDA allocator statistics; it needs a CUDA device")
            return 2
        records = run_memory(mcfg)
    else:
        cfg = parse_args(argv)
        if cfg.device == "cuda" and not torch.cuda.is_available():
            _log("--device cuda but CUDA is not available")
            return 2
        records = run_speed(cfg)
    return 1 if any(r["status"] == "error" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
