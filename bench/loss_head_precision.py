"""The chunked head's bf16 precision against the number of chunks: the relative error of the head's
weight gradient (and of the hidden states' gradient) against an fp64 reference, beside the model's
own loss (one bf16 matmul over every token). In bf16 the head's gradient accumulates in bf16, one
rounding per chunk (hf_memstack/transforms/loss_head/fused_ce.py), so its error grows with the
number of chunks; the loss and the hidden states' gradient do not.

    python bench/loss_head_precision.py     # 4,096 tokens, hidden 64, vocab 500: seconds
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_memstack.transforms.loss_head.chunked import chunked_lm_loss

HIDDEN, VOCAB, TOKENS = 64, 500, 4096


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def main() -> None:
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(1, TOKENS, HIDDEN)
    labels = torch.randint(0, VOCAB, (1, TOKENS))

    h = hidden.double().requires_grad_()
    w = head.weight.detach().double().requires_grad_()
    F.cross_entropy((h @ w.t())[0, :-1], labels[0, 1:]).backward()
    want_w, want_h = w.grad, h.grad

    def run(loss_of) -> tuple[float, float]:
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(h)
        loss.backward()
        return _relative(head.weight.grad, want_w), _relative(h.grad, want_h)

    print(f"{TOKENS} tokens, hidden {HIDDEN}, vocab {VOCAB}, bf16 autocast; relative error against fp64")
    print("| loss | chunks | head weight's gradient | hidden states' gradient |\n|---|---|---|---|")
    own = run(lambda h: F.cross_entropy(head(h).float()[0, :-1], labels[0, 1:]))
    print(f"| the model's own | - | {own[0]:.2e} | {own[1]:.2e} |")
    for chunk in (4096, 512, 64, 32, 8):
        err = run(lambda h, chunk=chunk: chunked_lm_loss(h, head, labels=labels, chunk_tokens=chunk))
        print(f"| loss:chunked | {-(-(TOKENS - 1) // chunk)} | {err[0]:.2e} | {err[1]:.2e} |")


if __name__ == "__main__":
    main()
