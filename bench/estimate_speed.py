"""How long the estimator takes on real model shapes, and that its extrapolation from two shallow
traces gives the full trace's bytes: a Llama-2-7B-shaped and a Llama-3-70B-shaped config (bf16
weights, LoRA r=16, bf16+ckpt, batch 1 x 2,048 tokens), and the planner walking the ladder for
the 7B at 16 GiB.

Each timing is one call in this process after a warm-up estimate of a tiny model (imports and
first-call caches paid there, as a notebook or a second CLI call pays them once); the process's
own start (``import hf_memstack``, PEFT) is printed apart.

    python bench/estimate_speed.py               # ~2 minutes on 2 CPU cores (the 7B full trace included)
    python bench/estimate_speed.py --full-70b    # also the 70B's full trace (minutes more)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

t_start = time.perf_counter()
import torch  # noqa: E402
from _common import machine  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from hf_memstack import estimate_memory, plan_policy  # noqa: E402

t_imports = time.perf_counter() - t_start

SHAPES = {
    "llama-2-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "vocab_size": 32000},
    "llama-3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "vocab_size": 128256},
}
JOB = {"batch_size": 1, "seq_len": 2048, "trainable": {"r": 16}}
POLICY = "bf16+ckpt"


def config(shape: str) -> LlamaConfig:
    return LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, dtype="bfloat16")


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def fields(estimate) -> dict:
    values = dataclasses.asdict(estimate)
    values.pop("notes")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full-70b", action="store_true", help="also trace the 70B's every block, to compare")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "estimate_speed.json"))
    args = ap.parse_args()
    print(machine(), f"torch threads {torch.get_num_threads()}", f"imports {t_imports:.1f} s", sep="\n")
    tiny = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256)
    _, warm = timed(lambda: estimate_memory(tiny, POLICY, batch_size=1, seq_len=32, trainable={"r": 16}))
    print(f"warm-up estimate (tiny model, first call): {warm:.1f} s")
    rows = []
    for shape in SHAPES:
        fast, t_fast = timed(lambda shape=shape: estimate_memory(config(shape), POLICY, **JOB))
        row = {"shape": shape, "seconds": round(t_fast, 2), "peak_bytes": fast.peak_bytes, "notes": list(fast.notes)}
        if shape == "llama-2-7b":  # a second rung, whose peak sits elsewhere (no checkpointing)
            other = [estimate_memory(config(shape), "bf16+loss:chunked", **JOB, extrapolate=e) for e in (True, False)]
            row["bf16+loss:chunked_equal_to_full_trace"] = fields(other[0]) == fields(other[1])
            print(f"{shape} bf16+loss:chunked: every field equal to the full trace: {row['bf16+loss:chunked_equal_to_full_trace']}")
        if shape == "llama-2-7b" or args.full_70b:
            full, t_full = timed(lambda shape=shape: estimate_memory(config(shape), POLICY, **JOB, extrapolate=False))
            diff = {k: (v, fields(full)[k]) for k, v in fields(fast).items() if fields(full)[k] != v}
            row |= {"full_trace_seconds": round(t_full, 2), "equal_to_full_trace": not diff, "differences": diff}
        rows.append(row)
        print(f"{shape}: {t_fast:.1f} s, peak {fast.peak_bytes / 2**30:.2f} GiB"
              + (f"; full trace {row['full_trace_seconds']:.1f} s, every field equal: {row['equal_to_full_trace']}"
                 if "full_trace_seconds" in row else ""))
    plan, t_plan = timed(lambda: plan_policy(config("llama-2-7b"), budget="16GiB", seq_len=2048, trainable={"r": 16}, device="cuda"))
    one = rows[0]["seconds"]
    print(f"plan llama-2-7b at 16 GiB (LoRA, cuda): {t_plan:.1f} s = {t_plan / one:.2f}x one estimate, "
          f"{len(plan.rows)} rungs considered, {sum(r.traced for r in plan.rows)} traced, "
          f"{sum(r.interpolated for r in plan.rows)} read between their neighbours; chose {plan.policy.to_string() if plan.fits else 'nothing'}")
    print(plan.table())
    out = {"machine": machine(), "imports_seconds": round(t_imports, 2), "estimates": rows,
           "plan": {"seconds": round(t_plan, 2), "x_one_estimate": round(t_plan / one, 2), "rungs": len(plan.rows), "traced": sum(r.traced for r in plan.rows),
                    "chose": plan.policy.to_string() if plan.fits else None}}
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
