"""Triton backend: forward/backward kernels for CUDA GPUs (and the Triton interpreter)."""
from .launch_bwd import backward
from .launch_fwd import forward

__all__ = ["forward", "backward"]
