"""The recipe's job with pure bf16 weights and *plain* AdamW (no stochastic rounding): what a
hand-written loop over a bf16 model gets, and what ``weights:bf16`` exists to avoid. For
bench/optimizer_curves.py only: it runs recipes/finetune.py with its ``build_optimizer`` replaced
by ``torch.optim.AdamW`` over the same parameter groups. The policy must be ``...+weights:bf16``
(so prepare_model casts the trainable weights to bf16, as a bf16 checkpoint would be).

    python bench/_plain_adamw.py --policy bf16+weights:bf16 --max-steps 200 ...   # the recipe's flags
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(ROOT / "recipes"))  # the script imports finetune_support from its folder
    spec = importlib.util.spec_from_file_location("finetune", ROOT / "recipes" / "finetune.py")
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["finetune"] = recipe
    spec.loader.exec_module(recipe)

    def plain_adamw(cfg, model, policy):  # noqa: ANN001, ANN202 - the recipe's signature
        assert policy.master_weights == "bf16", "run with a weights:bf16 policy (bf16 trainable weights)"
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        assert {p.dtype for p in decay + no_decay} == {torch.bfloat16}
        warnings.warn("bench: plain torch.optim.AdamW over bf16 weights (no stochastic rounding)", stacklevel=1)
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.train.lr,
            foreach=True,
        )

    recipe.build_optimizer = plain_adamw
    recipe.main()


if __name__ == "__main__":
    main()
