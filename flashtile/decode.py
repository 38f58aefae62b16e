"""Former name of :mod:`flashtile.kvcache` (``flash_attn_with_kvcache`` and its helpers);
``import flashtile.decode`` gives that module itself, so settings such as ``EAGER_PLANS`` set
through either name are one and the same."""
import sys

from . import kvcache

sys.modules[__name__] = kvcache
