"""The ladder's presets: the policy names users pick from, cheapest first, each adding a tool only
when the one before is not enough. Plain data with no imports, so that :mod:`hf_memstack.policy`
(which accepts them as names) and :mod:`hf_memstack.planning.plan.rungs` (which walks the rungs between them)
both read it without importing each other."""

from __future__ import annotations

__all__ = ["LADDER"]

LADDER: dict[str, str] = {
    "fp32": "fp32",
    "bf16": "bf16",
    "bf16+compile": "bf16+compile",
    "bf16+compile+ckpt": "bf16+compile+ckpt",
    "fsdp": "bf16+ckpt+fsdp",
}
