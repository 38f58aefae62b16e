"""flashtile: exact FlashAttention (forward and backward) as Triton kernels, with a tiled
PyTorch engine for CPUs.  See ``flashtile.interface`` for the functions' documentation."""
from ._validate import FlashtileInputError
from .backends import use_backend
from .block_sparse import (block_mask_from_dense, block_sparse_attn_func, butterfly_block_mask,
                           expand_block_mask, global_block_mask, local_block_mask,
                           strided_block_mask)
from .kvcache import flash_attn_with_kvcache, merge_attention_states
from .masks import build_tree_mask
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func,
                        scaled_dot_product_attention)
from .padding import (index_first_axis, index_first_axis_residual, index_put_first_axis,
                      pad_input, unpad_input, unpad_input_for_concatenated_sequences)

__version__ = "0.1.0"

__all__ = [
    "FlashtileInputError",
    "block_mask_from_dense",
    "block_sparse_attn_func",
    "butterfly_block_mask",
    "expand_block_mask",
    "global_block_mask",
    "local_block_mask",
    "pad_input",
    "strided_block_mask",
    "unpad_input",
    "build_tree_mask",
    "flash_attn_with_kvcache",
    "merge_attention_states",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "unpad_input_for_concatenated_sequences",
    "scaled_dot_product_attention",
    "use_backend",
]
