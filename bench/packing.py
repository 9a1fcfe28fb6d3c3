"""Packing against padding on a variable-length instruction-style dataset, side by side in one run:
the same samples, one epoch each, at the same token budget per step.

    python bench/packing.py                      # 600 samples, lognormal lengths (median 200, max 2048)
    python bench/packing.py --samples 300 --budget 4096

The data: prompt + response samples whose lengths are lognormal (median ``--median`` tokens, capped
at ``--max-len``), the prompt (30%) masked with -100, tokens drawn from a fixed random bigram model
so that the loss can fall. A Llama-shaped model built from a config (``--precision``, ``auto`` by default).

* padded: the shuffled samples, batched greedily up to ``--budget`` token slots (each batch padded
  to its longest sample, ``attention_mask`` and -100 labels on the padding);
* packed: ``pack_dataset`` (best-fit decreasing) into rows of ``--max-len`` tokens, the rows batched
  ``--budget // --max-len`` at a time by ``PackedCollator`` (``position_ids`` restarting, no mask),
  attention per sample (``prepare_model``'s ``hf_memstack_sdpa``);
* packed_whole_rows: the same packed batches under Transformers' own SDPA, which attends over each
  whole row with its block-diagonal mask (what the per-sample attention saves).

The three runs alternate step by step (each from the same initial weights, with its own AdamW), so the
machine's load falls on all alike. Reported: real (non-pad) tokens per second, the padding
fraction, the steps an epoch takes, the first step's peak (the meter), the held-out loss after the
epoch (each validation sample alone), and the estimator against the meter for both layouts.
Results: ``bench/results/packing.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, measured_against_estimate  # noqa: E402

from hf_memstack import make_optimizer, measure_step, prepare_model  # noqa: E402
from hf_memstack.data import PackedCollator, pack_dataset, padding_stats  # noqa: E402
from hf_memstack.transforms.precision.apply import cpu_has_native_bf16, resolve_precision  # noqa: E402


def make_samples(n: int, args: argparse.Namespace, seed: int) -> list[dict[str, list[int]]]:
    """Prompt/response samples from one bigram model (the same for every seed), lengths lognormal."""
    table = torch.Generator().manual_seed(1234)
    successors = torch.randint(3, args.vocab, (args.vocab, 4), generator=table)  # each token: 4 likely next tokens
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = max(8, min(args.max_len, int(rng.lognormvariate(math.log(args.median), args.sigma))))
        ids = [int(torch.randint(3, args.vocab, (1,), generator=g))]
        picks = torch.randint(0, 4, (length - 1,), generator=g).tolist()
        for k in picks:
            ids.append(int(successors[ids[-1], k]))
        prompt = int(0.3 * length)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def padded_batches(samples: list[dict[str, list[int]]], budget: int, seed: int) -> list[dict[str, torch.Tensor]]:
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    batches, current = [], []
    for i in order:
        longest = max([len(samples[j]["input_ids"]) for j in current] + [len(samples[i]["input_ids"])])
        if current and longest * (len(current) + 1) > budget:
            batches.append(_pad([samples[j] for j in current]))
            current = []
        current.append(i)
    if current:
        batches.append(_pad([samples[j] for j in current]))
    return batches


def _pad(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for k, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[k, :n], labels[k, :n], mask[k, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def packed_batches(
    samples: list[dict[str, list[int]]], args: argparse.Namespace, seed: int
) -> list[dict[str, torch.Tensor]]:
    rows = pack_dataset(samples, args.max_len)
    random.Random(seed).shuffle(rows)
    per_step = max(1, args.budget // args.max_len)
    collate = PackedCollator(pad_to=args.max_len)
    return [collate(rows[i : i + per_step]) for i in range(0, len(rows), per_step)]


def model_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=args.vocab,
        max_position_embeddings=args.max_len,
        attn_implementation="sdpa",
    )


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-pad tokens: the mask's ones when padded; packed rows pad with token 0, which no sample draws (ids from 3)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int((batch["input_ids"] != 0).sum())


def held_out_loss(model: torch.nn.Module, samples: list[dict[str, list[int]]]) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids, labels = torch.tensor([s["input_ids"]]), torch.tensor([s["labels"]])
            logits = model(input_ids=ids).logits[0, :-1].float()
            target = labels[0, 1:]
            total += float(F.cross_entropy(logits, target, ignore_index=-100, reduction="sum"))
            count += int((target != -100).sum())
    return total / count


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    precision = resolve_precision(args.precision, "cpu").name
    policy = f"{precision}+loss:chunked"
    train, val = (
        make_samples(args.samples, args, seed=args.seed),
        make_samples(args.val_samples, args, seed=10_000 + args.seed),
    )
    layouts = {
        "padded": padded_batches(train, args.budget, args.seed),
        "packed": packed_batches(train, args, args.seed),
    }
    torch.manual_seed(args.seed)
    base = LlamaForCausalLM(model_config(args)).train()
    sides: dict[str, Any] = {}
    # "packed_whole_rows": the same packed batches under Transformers' own SDPA, which attends over
    # each whole row with its block-diagonal mask (prepare_model's per-sample attention undone).
    for name, batches in (*layouts.items(), ("packed_whole_rows", layouts["packed"])):
        model = _prepared(base, policy, whole_rows=name == "packed_whole_rows")
        first = batches[max(range(len(batches)), key=lambda i: batches[i]["input_ids"].numel())]
        peak = measure_step(model, first, make_optimizer(model, lr=1e-4), timed=False)  # on a copy that does not train
        sides[name] = {
            "model": _prepared(base, policy, whole_rows=name == "packed_whole_rows"),
            "batches": batches,
            "seconds": 0.0,
            "tokens": 0,
            "slots": sum(b["input_ids"].numel() for b in batches),
            "losses": [],
            "peak_bytes": peak.peak_bytes,
            "largest_batch": list(first["input_ids"].shape),
        }
        sides[name]["optimizer"] = make_optimizer(sides[name]["model"], lr=args.lr)
    steps = max(len(s["batches"]) for s in sides.values())
    names = list(sides)
    for i in range(steps):  # alternate: one step of each, in turn, the order rotating
        for name in names[i % len(names) :] + names[: i % len(names)]:
            side = sides[name]
            if i >= len(side["batches"]):
                continue
            batch = side["batches"][i]
            start = time.perf_counter()
            loss = side["model"](**batch).loss
            loss.backward()
            side["optimizer"].step()
            side["optimizer"].zero_grad(set_to_none=True)
            side["seconds"] += time.perf_counter() - start
            side["tokens"] += real_tokens(batch)
            side["losses"].append(float(loss.detach()))
    out: dict[str, Any] = {
        "policy": policy,
        "samples": len(train),
        "train_tokens": sum(len(s["input_ids"]) for s in train),
    }
    for name, side in sides.items():
        out[name] = {
            "steps": len(side["batches"]),
            "seconds": side["seconds"],
            "tokens_per_s": side["tokens"] / side["seconds"],
            "real_tokens": side["tokens"],
            "slots": side["slots"],
            "padding_fraction": 1 - side["tokens"] / side["slots"],
            "peak_bytes": side["peak_bytes"],
            "largest_batch": side["largest_batch"],
            "held_out_loss": held_out_loss(side["model"], val),
            "first_loss": side["losses"][0],
            "last_loss": side["losses"][-1],
        }
    out["speedup"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
    out["speedup_whole_rows"] = out["packed_whole_rows"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
    out["padding_before"] = padding_stats([len(s["input_ids"]) for s in train], 8).padding_fraction
    out["estimates"] = estimates(args, policy, layouts)
    return out


def _prepared(base: torch.nn.Module, policy: str, *, whole_rows: bool) -> torch.nn.Module:
    model = prepare_model(copy.deepcopy(base), policy)
    if whole_rows:
        model.set_attn_implementation("sdpa")
    return model


def estimates(
    args: argparse.Namespace, policy: str, layouts: dict[str, list[dict[str, torch.Tensor]]]
) -> list[dict[str, Any]]:
    """The estimator against the meter on one full batch of each layout (AdamW, the first step)."""
    rows = []
    per_step = max(1, args.budget // args.max_len)
    packed = next(b for b in layouts["packed"] if b["input_ids"].shape[0] == per_step)
    # Unpacked rows as long as the packed ones, without padding (no mask: causal attention needs none).
    ids = torch.randint(3, args.vocab, (per_step, args.max_len), generator=torch.Generator().manual_seed(99))
    unpacked = {"input_ids": ids, "labels": ids}
    for name, batch, is_packed in (("packed", packed, True), ("unpacked, no padding", unpacked, False)):
        figures = measured_against_estimate(
            model_config(args), policy, batch, estimate_cfg=model_config(args), packed=is_packed
        )
        rows.append({"layout": name, "shape": list(batch["input_ids"].shape), **figures})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--val-samples", type=int, default=40)
    ap.add_argument("--median", type=int, default=200)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=4096, help="token slots per step, padding included")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "packing.json"))
    args = ap.parse_args()
    native = cpu_has_native_bf16()
    print(f"machine: {machine()}; native bf16: {'yes' if native else 'no'}")
    out = run(args)
    print(
        f"\n{out['samples']} samples, {out['train_tokens']} tokens, lognormal lengths (median {args.median}, max {args.max_len}), "
        f"{args.budget} token slots per step, {out['policy']}, one epoch each, steps alternating\n"
    )
    print(
        "| layout | steps | padding | real tokens/s | peak MiB (first step) | loss first -> last step | held-out loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in ("padded", "packed", "packed_whole_rows"):
        r = out[name]
        print(
            f"| {name} | {r['steps']} | {r['padding_fraction']:.1%} | {r['tokens_per_s']:.0f} | {r['peak_bytes'] / 2**20:.0f} | "
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {r['held_out_loss']:.4f} |"
        )
    print(
        f"\npacked / padded tokens per second: {out['speedup']:.2f}x (target >= 1.5x; with Transformers' whole-row SDPA "
        f"{out['speedup_whole_rows']:.2f}x); padding of fixed batches of 8 "
        f"padded to their longest: {out['padding_before']:.1%}"
    )
    for e in out["estimates"]:
        print(
            f"estimator, {e['layout']} batch {e['shape']}: measured {e['measured'] / 2**20:.1f} MiB, estimated "
            f"{e['estimated'] / 2**20:.1f} MiB ({e['error']:+.1%})"
        )
    Path(args.out).write_text(
        json.dumps({"machine": machine(), "native_bf16": native, "args": vars(args), **out}, indent=1)
    )


if __name__ == "__main__":
    main()
