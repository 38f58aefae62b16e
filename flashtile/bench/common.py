"""Shared pieces of the benchmark harness: inputs, implementations, modes, timers, records,
argument parsers, progress and the results files (one JSON object per device).

Implementations (``IMPLS``) and modes (``MODES``) are registries: adding one is a function plus a
dict entry.  An implementation's ``prepare`` turns the shared ``(B, N, H, d)`` inputs into a
``Prepared`` (a zero-argument forward, its leaf tensors, the upstream gradient in the same
layout); a mode's ``build`` turns a ``Prepared`` into the callable that is timed, doing any
untimed setup itself (``bwd`` runs the forward once there and times only the backward).

On CUDA the timer is ``triton.testing.do_bench(..., return_mode="median")``; on CPU it is the
median of ``time.perf_counter`` intervals.
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Where a memory or variants run writes and how it reports (keyword-only fields)."""

    out: Path | None = None  # results file; None: the device's, benchmarks/results/<device>.json
    plots: Path = Path("bench_out")
    seed: int = 0
    plot: bool = True
    progress: bool = True
    raise_errors: bool = False


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


def flashtile_api():
    import flashtile

    if not hasattr(flashtile, "flash_attn_func"):
        raise ImportError("flashtile.flash_attn_func is not available")
    return flashtile


def _flashtile_use_backend():
    ft = flashtile_api()
    use_backend = getattr(ft, "use_backend", None)
    if use_backend is None:
        from flashtile.backends import use_backend
    return use_backend


def flashtile_context(device: torch.device) -> ContextManager:
    return _flashtile_use_backend()("triton" if device.type == "cuda" else "torch")


@contextlib.contextmanager
def env_set(name: str, value: str):
    """``os.environ[name] = value`` inside the block."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def flashtile_chunked_context(device: torch.device):
    """flashtile with ``FLASHTILE_BWD_CHUNK=auto``: the backward in batch chunks that fit L2."""
    with env_set("FLASHTILE_BWD_CHUNK", "auto"), flashtile_context(device):
        yield


@contextlib.contextmanager
def flashtile_portable_context(device: torch.device):
    """flashtile with ``FLASHTILE_SM90=0``: the portable Triton kernels where the Hopper ones
    would run (an A/B of the two in one process)."""
    with env_set("FLASHTILE_SM90", "0"), flashtile_context(device):
        yield


def _prepare_flashtile(inp: Inputs, causal: bool, scale: float,
                       deterministic: bool = False) -> Prepared:
    ft = flashtile_api()
    q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
    kw = {"deterministic": True} if deterministic else {}

    def fn():
        out = ft.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **kw)
        return out[0] if isinstance(out, tuple) else out

    return Prepared(fn, (q, k, v), inp.dout)


def _prepare_flashtile_deterministic(inp: Inputs, causal: bool, scale: float) -> Prepared:
    return _prepare_flashtile(inp, causal, scale, deterministic=True)


def _prepare_flashtile_sdpa(inp: Inputs, causal: bool, scale: float) -> Prepared:
    """flashtile's ``scaled_dot_product_attention`` on the SDPA peers' ``(B, H, N, d)`` copies:
    the layout the drop-in and transformers models hand the kernels."""
    ft = flashtile_api()
    q, k, v = (bhnd(t).requires_grad_() for t in (inp.q, inp.k, inp.v))

    def fn():
        return ft.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    return Prepared(fn, (q, k, v), bhnd(inp.dout))


def bhnd(t: torch.Tensor) -> torch.Tensor:
    """``(B, N, H, d)`` -> contiguous ``(B, H, N, d)`` copy of the same values."""
    return t.detach().transpose(1, 2).contiguous()


def _prepare_sdpa(inp: Inputs, causal: bool, scale: float) -> Prepared:
    q, k, v = (bhnd(t).requires_grad_() for t in (inp.q, inp.k, inp.v))

    def fn():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    return Prepared(fn, (q, k, v), bhnd(inp.dout))


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
    q, k, v = (bhnd(t).requires_grad_() for t in (inp.q, inp.k, inp.v))

    def fn():
        return compiled(q, k, v, block_mask=block_mask, scale=scale)

    return Prepared(fn, (q, k, v), bhnd(inp.dout))


def flex_context(device: torch.device) -> ContextManager:
    # the bwd mode backpropagates through one graph repeatedly (retain_graph=True), which
    # AOTAutograd forbids when the backward donates saved buffers
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "donated_buffer"):
        return functorch_config.patch(donated_buffer=False)
    return contextlib.nullcontext()


def reset_flex_cache() -> None:
    _FLEX.update(key=None, fn=None, block_mask=None)


# SDPA with no backend forced: PyTorch picks (cuDNN on an H100 with torch 2.11). Named "sdpa" in
# the CPU preset and "sdpa_default" in the CUDA one, beside the forced backends.
_SDPA_DEFAULT = Impl(_prepare_sdpa, description="SDPA with no backend forced (PyTorch's choice)")

IMPLS: dict[str, Impl] = {
    "flashtile": Impl(_prepare_flashtile, flashtile_context, peer=False,
                      description="flashtile.flash_attn_func (triton on CUDA, torch on CPU)"),
    "flashtile_chunked": Impl(_prepare_flashtile, flashtile_chunked_context, peer=False,
                              description="flashtile with FLASHTILE_BWD_CHUNK=auto (backward in "
                                          "batch chunks that fit L2)"),
    "flashtile_portable": Impl(_prepare_flashtile, flashtile_portable_context, peer=False,
                               description="flashtile with FLASHTILE_SM90=0 (the portable "
                                           "Triton kernels instead of the Hopper ones)"),
    "flashtile_sdpa": Impl(_prepare_flashtile_sdpa, flashtile_context, peer=False,
                           description="flashtile.scaled_dot_product_attention on (B, H, N, d) "
                                       "inputs (the drop-in's and transformers' layout)"),
    "flashtile_deterministic": Impl(_prepare_flashtile_deterministic, flashtile_context,
                                    peer=False,
                                    description="flashtile with deterministic=True (on Hopper "
                                                "the backward without atomics)"),
    "sdpa": _SDPA_DEFAULT,
    "sdpa_default": _SDPA_DEFAULT,
    "sdpa_flash": Impl(_prepare_sdpa, _sdpa_context("FLASH_ATTENTION"),
                       description="SDPA, SDPBackend.FLASH_ATTENTION (FlashAttention-2)"),
    "sdpa_cudnn": Impl(_prepare_sdpa, _sdpa_context("CUDNN_ATTENTION"),
                       description="SDPA, SDPBackend.CUDNN_ATTENTION"),
    "sdpa_efficient": Impl(_prepare_sdpa, _sdpa_context("EFFICIENT_ATTENTION"),
                           description="SDPA, SDPBackend.EFFICIENT_ATTENTION (xformers kernel)"),
    "sdpa_math": Impl(_prepare_sdpa, _sdpa_context("MATH"),
                      description="SDPA, SDPBackend.MATH (standard attention, N x N scores)"),
    "flex": Impl(_prepare_flex, flex_context,
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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache(device: torch.device) -> None:
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


def utc_now() -> str:
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
    rec["date"] = utc_now()
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


def case_fields(case: Case) -> dict[str, Any]:
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
    return make_record(env, **case_fields(case), tflops=tflops, ms=ms, status=status,
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
                synchronize(device)
                ms = timer(fn)
                synchronize(device)
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
    empty_cache(device)
    return status, error, ms

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


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def flatten(values: Iterable[str] | None, convert: Callable[[str], Any]) -> tuple | None:
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


def parse_names(values: list[str] | None, allowed: Sequence[str],
                what: str) -> tuple[str, ...] | None:
    if values is None:
        return None
    if [v.strip() for v in values] == ["all"]:
        return tuple(allowed)
    return flatten(values, _choice(allowed, what))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def common_arguments(p: argparse.ArgumentParser, key: str, plots: str) -> None:
    """The flags every sweep shares: where its records go (``--out``, under ``key``), where its
    plots go (``plots`` names them), the device, progress and error handling."""
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help=f"results JSON of the device; this run's records are merged into its "
                        f"'{key}' entry, a record replacing an older one of the same case "
                        f"(default: {RESULTS_DIR}/<device>.json, e.g. h100.json, cpu.json)")
    p.add_argument("--plots", type=Path, default=Path("bench_out"), metavar="DIR",
                   help=f"directory for {plots} (default: bench_out)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG plots")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raise-errors", action="store_true",
                   help="re-raise the first failing case instead of recording it (debugging)")

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


def log(msg: str) -> None:
    print(msg, file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Output: JSON, table, plots
# --------------------------------------------------------------------------------------------

# Every benchmark writes into one JSON object per device, ``benchmarks/results/<device>.json``
# (``h100.json``, ``cpu.json``), one entry per command: ``speed``, ``memory`` and ``device``
# (speed's device ceilings), ``variants``, ``decode``, ``io``, ``cp_*``, ``train_*``, ...
RESULTS_DIR = Path("benchmarks") / "results"
_VENDOR_WORDS = {"nvidia", "amd", "intel", "geforce", "tesla", "instinct", "radeon"}


def device_tag(device: torch.device | str = "cuda") -> str:
    """The short name of a device, which names its results file: ``cpu``, or the GPU's model
    (``h100`` for "NVIDIA H100 80GB HBM3", ``a100``, ``rtx4090``, ``mi300x``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    words = [w for w in re.findall(r"[A-Za-z0-9]+", torch.cuda.get_device_name(device))
             if w.lower() not in _VENDOR_WORDS]
    if not words:
        return "cuda"
    tag = words[0]
    if tag.isalpha() and len(words) > 1:  # "RTX 4090" -> rtx4090
        tag += words[1]
    return tag.lower()


def results_path(device: torch.device | str, out: Path | str | None = None) -> Path:
    """``out``, or by default the device's results file ``benchmarks/results/<device>.json``."""
    return Path(out) if out is not None else RESULTS_DIR / f"{device_tag(device)}.json"


def write_json(path: Path | str, data: Any) -> Path:
    """Write ``data`` as JSON atomically (temporary file then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=str)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``path``'s directory, so that two runs writing entries of one
    results file do not lose each other's (a no-op where ``fcntl`` is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def read_results(path: Path | str) -> dict[str, Any]:
    """The entries of a results file (``{}`` when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return {}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with one entry per benchmark")
    return data


def read_result(path: Path | str, key: str, default: Any = None) -> Any:
    """Entry ``key`` of a results file (``default`` when the file or the entry is missing)."""
    return read_results(path).get(key, default)


def update_result(path: Path | str, key: str, update: Callable[[Any], Any]) -> Path:
    """Set entry ``key`` of the results file ``path`` to ``update(old entry or None)``, keeping
    every other entry: read, merge and write under a lock, the write atomic."""
    path = Path(path)
    with _locked(path):
        data = read_results(path)
        data[key] = update(data.get(key))
        return write_json(path, data)


def write_result(path: Path | str, key: str, payload: Any) -> Path:
    """Store ``payload`` as entry ``key`` of the results file ``path`` (other entries kept)."""
    return update_result(path, key, lambda old: payload)


def load_records(path: Path | str, key: str | None = None) -> list[dict[str, Any]]:
    """The records of a JSON list, or of entry ``key`` of a results file (``[]`` if missing)."""
    if key is not None:
        data = read_result(path, key, [])
    else:
        with open(path) as f:
            data = json.load(f)
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        where = f"{path} [{key}]" if key is not None else str(path)
        raise ValueError(f"{where}: expected a JSON list of records")
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


def merge_result(path: Path | str, key: str, records: list[dict],
                 record_id: Callable[[dict], tuple] = record_key) -> Path:
    """Merge ``records`` into the record list at entry ``key`` of the results file ``path``."""
    return update_result(path, key, lambda old: merge_records(old or [], records, record_id))
