"""Reference implementations: the oracles the tests compare against.

``torch_ref``   plain attention in torch (float64 by default) and a RoPE oracle: the tests' oracle.
``naive``       materialised attention in float64 NumPy (forward and analytic backward).
``algorithms``  the FlashAttention papers' blockwise algorithms for one head, for reading, and the
                bytes they and flashtile's kernels move (the paper's IO analysis, Theorem 2).
"""
from . import algorithms, naive
from .naive import attention, attention_backward, visibility_mask

__all__ = ["algorithms", "naive", "attention", "attention_backward", "visibility_mask"]
