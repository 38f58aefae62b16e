"""Context-parallel attention over ``torch.distributed`` (see ``docs/distributed.md``).

``shard`` / ``unshard`` split a sequence over the ranks of a process group and back;
``context_parallel_attn`` (and its varlen form) computes attention on the shards, forward and
backward, equal to one ``flash_attn_func`` call on the whole sequence; ``partial_attention`` is
the kernels' entry point for one block of queries against one block of keys at global offsets.
"""
from .context_parallel import (LAYOUTS, MODES, context_parallel_attn,
                               context_parallel_varlen_attn, shard, unshard)
from .partial import partial_attention, partial_attention_backward

__all__ = ["LAYOUTS", "MODES", "context_parallel_attn", "context_parallel_varlen_attn",
           "partial_attention", "partial_attention_backward", "shard", "unshard"]
