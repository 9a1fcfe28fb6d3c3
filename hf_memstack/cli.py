"""hf-memstack: will it fit, and what is the cheapest way to make it fit?

    hf-memstack estimate MODEL --policy bf16+ckpt --batch-size 8 --seq-len 2048 [--world-size 8]
    hf-memstack plan MODEL --budget 80GiB --seq-len 4096 [--batch-size 16|max]
    hf-memstack find-batch-size MODEL --policy bf16+ckpt --seq-len 1024 [--budget 20GiB]

MODEL is a local directory or a hub id already in the local cache (nothing is downloaded).
A table by default, --json for scripts, --plot FILE.png for a picture (needs matplotlib).
Exit status: 0 fits, 1 does not fit, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .memory import format_bytes

FITS, DOES_NOT_FIT, USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-memstack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{estimate,plan,find-batch-size}")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("model", help="local directory or cached hub id")
        sp.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
        sp.add_argument("--task", default="causal-lm", choices=["causal-lm", "classification"], help="which head (default causal-lm)")
        sp.add_argument("--json", action="store_true", help="print JSON instead of a table")

    e = sub.add_parser("estimate", help="peak memory of one training step, by category", description="Estimate one training step's peak memory per device, without loading weights.")
    common(e)
    e.add_argument("--policy", default="fp32", help="memory policy string, e.g. bf16+ckpt (default fp32); several, comma-separated, to compare")
    e.add_argument("--batch-size", type=int, required=True, help="per-device micro-batch size")
    e.add_argument("--world-size", type=int, default=1, help="devices sharing an FSDP policy (default 1)")
    e.add_argument("--budget", help="device memory, e.g. 24GiB: exit 1 when the estimate does not fit")
    e.add_argument("--plot", help="write the breakdown as a stacked bar per policy to this PNG")

    pl = sub.add_parser("plan", help="the cheapest policy that fits a budget", description="Walk the ladder and pick the cheapest policy that fits.")
    common(pl)
    pl.add_argument("--budget", required=True, help="per-device memory, e.g. 80GiB")
    pl.add_argument("--batch-size", default="1", help="per-device batch size, or 'max' (default 1)")
    pl.add_argument("--world-size", type=int, default=1, help="devices (FSDP rungs are considered when > 1)")
    pl.add_argument("--margin", type=float, default=0.1, help="fraction of the budget kept free (default 0.1)")
    pl.add_argument("--plot", help="write the breakdown of every rung considered to this PNG")

    f = sub.add_parser("find-batch-size", help="measure the largest batch that fits (real steps)", description="Run the batch-size finder on the model built from its config (random weights: memory does not depend on their values).")
    common(f)
    f.add_argument("--policy", default="fp32", help="memory policy string (default fp32)")
    f.add_argument("--budget", help="memory budget, e.g. 8GiB (required on CPU; CUDA: free memory)")
    f.add_argument("--global-batch-size", type=int, help="samples per optimizer step: report the accumulation steps")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"estimate": _estimate, "plan": _plan, "find-batch-size": _find}[args.command](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"hf-memstack {args.command}: error: {e}", file=sys.stderr)
        return USAGE


def _estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate_memory
    from .memory import parse_bytes

    budget = parse_bytes(args.budget) if args.budget else None
    estimates = [estimate_memory(args.model, policy.strip(), batch_size=args.batch_size, seq_len=args.seq_len,
                                 world_size=args.world_size, task=args.task) for policy in args.policy.split(",")]
    fits = budget is None or all(e.peak_bytes <= budget for e in estimates)
    if args.json:
        print(json.dumps({"estimates": [e.as_dict() for e in estimates], "budget": budget, "fits": fits}, indent=2))
    else:
        print("| policy | parameters | gradients | optimizer | activations | temporaries | peak | peak phase |")
        print("|---|---|---|---|---|---|---|---|")
        for e in estimates:
            print(f"| {e.policy} | {format_bytes(e.parameters)} | {format_bytes(e.gradients)} | {format_bytes(e.optimizer)} | "
                  f"{format_bytes(e.activations)} | {format_bytes(e.temporaries)} | {format_bytes(e.peak_bytes)} | {e.peak_phase} |")
        for note in dict.fromkeys(n for e in estimates for n in e.notes):
            print(f"note: {note}")
        if budget is not None:
            print(f"{'fits' if fits else 'does not fit'} in {format_bytes(budget)}")
    if args.plot:
        _plot([(e.policy, e) for e in estimates], args.plot, budget)
    return FITS if fits else DOES_NOT_FIT


def _plan(args: argparse.Namespace) -> int:
    from .estimate import estimate_memory
    from .planner import plan_policy

    batch: Any = args.batch_size if args.batch_size == "max" else _positive_int(args.batch_size, "--batch-size")
    plan = plan_policy(args.model, budget=args.budget, seq_len=args.seq_len, batch_size=batch, world_size=args.world_size,
                       margin=args.margin, task=args.task)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.table())
    if args.plot:
        b = plan.batch_size or 1
        _plot([(r.policy, estimate_memory(args.model, r.policy, batch_size=b, seq_len=args.seq_len, world_size=args.world_size,
                                          task=args.task)) for r in plan.rows], args.plot, plan.budget)
    return FITS if plan.fits else DOES_NOT_FIT


def _find(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from .batch_size import find_batch_size
    from .estimate import load_config
    from .prepare import prepare_model

    config = load_config(args.model)
    auto = AutoModelForCausalLM if args.task == "causal-lm" else AutoModelForSequenceClassification
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = prepare_model(auto.from_config(config, dtype=torch.float32).to(device).train(), args.policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (n, args.seq_len), device=device)
        labels = ids if args.task == "causal-lm" else torch.zeros(n, dtype=torch.long, device=device)
        return {"input_ids": ids, "labels": labels}

    try:
        result = find_batch_size(model, make_batch, optimizer, budget=args.budget, global_batch_size=args.global_batch_size)
    except ValueError as e:
        if "cannot hold one" in str(e) or "smaller than the model" in str(e):
            print(f"hf-memstack find-batch-size: does not fit: {e}", file=sys.stderr)
            return DOES_NOT_FIT
        raise
    print(json.dumps(result.as_dict(), indent=2, default=str) if args.json else result.summary())
    return FITS


def _positive_int(value: str, flag: str) -> int:
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{flag}={value!r} must be a positive integer or 'max'")
    return int(value)


def _plot(items: list[tuple[str, Any]], path: str, budget: int | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'hf_memstack[plot]'") from None
    cats = ["parameters", "gradients", "optimizer", "activations", "temporaries"]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(items)), 4))
    bottoms = [0.0] * len(items)
    for cat in cats:
        values = [getattr(e, cat) / 2**30 for _, e in items]
        ax.bar([name for name, _ in items], values, bottom=bottoms, label=cat)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if budget:
        ax.axhline(budget / 2**30, color="black", linestyle="--", label="budget")
    ax.set_ylabel("GiB per device")
    ax.set_title("estimated peak of one training step")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
