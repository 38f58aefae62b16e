"""Float64 NumPy reference implementations.

``naive``       materialised attention (forward and analytic backward): the test oracle.
``algorithms``  the FlashAttention papers' blockwise algorithms for one head, for reading.
"""
from . import algorithms, naive
from .naive import attention, attention_backward, visibility_mask

__all__ = ["algorithms", "naive", "attention", "attention_backward", "visibility_mask"]
