"""Triton backend: forward/backward and decode kernels for CUDA GPUs (and the Triton
interpreter)."""
from .launch_bwd import backward
from .launch_decode import decode, merge_states, record_decode
from .launch_fwd import forward

__all__ = ["forward", "backward", "decode", "merge_states", "record_decode"]
