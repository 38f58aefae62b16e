"""Torch backend: exact attention for any device in PyTorch ops (``attention.py``), and decode
against a KV cache (``decode.py``).

On the CPU, calls (and varlen calls' sequences) that PyTorch's fused kernel computes exactly go
to it; everything else runs the tiled engine (windows, softcap, ALiBi, dropout, biases,
block-sparse, paged).
"""
from .attention import backward, forward
from .decode import decode, merge_states

__all__ = ["forward", "backward", "decode", "merge_states"]
