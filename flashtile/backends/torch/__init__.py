"""Torch backend: the tiled PyTorch engine (dense, varlen, paged) and decode with PyTorch ops."""
from ..torch_tiled import backward, forward
from .decode import decode, merge_states

__all__ = ["forward", "backward", "decode", "merge_states"]
