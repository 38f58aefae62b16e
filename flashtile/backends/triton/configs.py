"""Block shapes and launch parameters for the Triton kernels.

``TUNED`` holds the winners of ``flashtile tune`` (``backends/triton/tune.py``) on real
hardware, keyed by ``(arch, pass, head_dim_bucket, causal, dtype)`` so a first call never
autotunes.  A key that is
missing falls back to ``_heuristic`` (shapes that fit in shared memory and registers for every
head dim).  Under ``TRITON_INTERPRET=1`` small tiles keep the emulated kernels fast.
``override(...)`` pins a config (tests use it to prove block-size invariance).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from .. import interpreting  # noqa: F401 - the launch modules import it from here


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# (arch "sm90", pass, d bucket, causal, dtype) -> (block_m, block_n, num_warps, num_stages)
# Winners of `flashtile tune` on an H100 (the searches and their raw results are in
# docs/dev/tuning-log.md).  Three backward entries changed after 2 and 4 pipeline stages
# joined the search, where the new winner led by more than 3%; smaller leads were within the
# noise of the sweep and the old entries stay.  fp16 uses the bf16 winners.
TUNED: dict[tuple, tuple[int, int, int, int]] = {
    ("sm90", "fwd", 64, False, "bfloat16"): (64, 64, 4, 3),
    ("sm90", "fwd", 64, True, "bfloat16"): (64, 64, 4, 3),
    ("sm90", "dkdv", 64, False, "bfloat16"): (64, 64, 4, 5),
    ("sm90", "dkdv", 64, True, "bfloat16"): (64, 64, 4, 1),
    ("sm90", "dq", 64, False, "bfloat16"): (128, 64, 8, 3),
    ("sm90", "dq", 64, True, "bfloat16"): (128, 64, 8, 3),
    ("sm90", "fwd", 128, False, "bfloat16"): (128, 64, 8, 4),
    ("sm90", "fwd", 128, True, "bfloat16"): (128, 128, 8, 3),
    ("sm90", "dkdv", 128, False, "bfloat16"): (64, 64, 4, 2),
    ("sm90", "dkdv", 128, True, "bfloat16"): (64, 64, 4, 1),
    ("sm90", "dq", 128, False, "bfloat16"): (128, 64, 8, 5),
    ("sm90", "dq", 128, True, "bfloat16"): (128, 64, 8, 3),
    ("sm90", "fwd", 256, False, "bfloat16"): (128, 64, 8, 2),
    ("sm90", "fwd", 256, True, "bfloat16"): (128, 64, 8, 2),
    ("sm90", "dkdv", 256, False, "bfloat16"): (64, 32, 4, 2),
    ("sm90", "dkdv", 256, True, "bfloat16"): (64, 32, 4, 3),
    ("sm90", "dq", 256, False, "bfloat16"): (64, 32, 4, 3),
    ("sm90", "dq", 256, True, "bfloat16"): (64, 32, 4, 3),
    # Sequences of at most SHORT_SEQ keys: fewer, smaller tiles keep all SMs busy (measured
    # at N=512 and 1K; the backward's from a search at N=512, leads of 3-5% that the N=1K
    # search agrees with; docs/dev/tuning-log.md).
    ("sm90", "fwd", 128, False, "bfloat16", "short"): (128, 32, 8, 3),
    ("sm90", "fwd", 128, True, "bfloat16", "short"): (64, 64, 4, 3),
    ("sm90", "dkdv", 64, False, "bfloat16", "short"): (64, 64, 4, 3),
    ("sm90", "dq", 64, False, "bfloat16", "short"): (128, 64, 8, 5),
}
SHORT_SEQ = 1024

# Pinned configs (:func:`override`) are process-wide, not per thread: the backward of a call
# made inside the block runs on autograd's device thread and must see them too.
_pinned: dict | None = None


def head_dim_bucket(head_dim: int) -> int:
    """Kernels are compiled for the next power of two >= 16 of the head dim."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _arch(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def _heuristic(pass_: str, d: int, arch: str) -> KernelConfig:
    if pass_ == "fwd":
        if d <= 64:
            return KernelConfig(128, 64, 4, 3)
        if d <= 128:
            return KernelConfig(128, 64, 8, 3)
        return KernelConfig(64, 64, 4, 2)
    if pass_ == "dkdv":
        if d <= 128:
            return KernelConfig(32, 128, 4, 3)
        return KernelConfig(32, 64, 4, 2)
    if pass_ == "dq":
        if d <= 128:
            return KernelConfig(128, 32, 4, 3)
        return KernelConfig(64, 32, 4, 2)
    raise ValueError(pass_)


def get_config(pass_: str, head_dim: int, causal: bool, dtype: torch.dtype,
               device: torch.device, seqlen: int = 0) -> KernelConfig:
    pinned = _pinned
    if pinned and pass_ in pinned:
        return pinned[pass_]
    if interpreting() or device.type != "cuda":
        return KernelConfig(16, 16, 1, 1)
    return _cuda_config(pass_, head_dim_bucket(head_dim), bool(causal), dtype, device.index,
                        0 < seqlen <= SHORT_SEQ)


@functools.lru_cache(maxsize=None)
def _cuda_config(pass_, d, causal, dtype, index, short) -> KernelConfig:
    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    arch = _arch(device)
    if dtype == torch.float32:
        # fp32 runs ieee dots with twice the register footprint per element.
        base = _heuristic(pass_, d, arch)
        return KernelConfig(max(16, base.block_m // 2), max(16, base.block_n // 2),
                            base.num_warps, 2)
    key = (arch, pass_, d, causal, "bfloat16")
    if short and key + ("short",) in TUNED:
        return KernelConfig(*TUNED[key + ("short",)])
    if key in TUNED:
        return KernelConfig(*TUNED[key])
    return _heuristic(pass_, d, arch)


def pinned_configs() -> bool:
    """Whether an :func:`override` is active in this thread."""
    return bool(_pinned)


@contextlib.contextmanager
def override(**configs: KernelConfig):
    """Pin configs for passes ``fwd``, ``dkdv``, ``dq`` inside the block (process-wide, so the
    backward that autograd runs on its own thread uses them too)."""
    global _pinned
    old = _pinned
    _pinned = {**(old or {}), **configs}
    try:
        yield
    finally:
        _pinned = old
