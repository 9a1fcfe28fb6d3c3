"""What multi-rank runs need around the transformations: FSDP2 sharding and its pre-flight, the Accelerate plugin,
weight loading and saving, sharded checkpoints read without running code, and one rank's error ending every rank.

The names a multi-rank run imports are re-exported here, each loaded on first use
(``from hf_memstack.distributed import from_pretrained_for_fsdp, save_pretrained_full``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ..errors import DistributedMismatchError
    from .accelerate import accelerate_fsdp_plugin
    from .checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
    from .weights import from_pretrained_for_fsdp, save_pretrained_full

# public name -> the module that defines it
_EXPORTS = {
    "DistributedMismatchError": "..errors",
    "accelerate_fsdp_plugin": ".accelerate",
    "load_sharded_checkpoint": ".checkpoint",
    "save_sharded_checkpoint": ".checkpoint",
    "from_pretrained_for_fsdp": ".weights",
    "save_pretrained_full": ".weights",
}

__all__ = [
    "DistributedMismatchError",
    "accelerate_fsdp_plugin",
    "from_pretrained_for_fsdp",
    "load_sharded_checkpoint",
    "save_pretrained_full",
    "save_sharded_checkpoint",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
