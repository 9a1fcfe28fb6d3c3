"""How long the estimator takes on real model shapes, and that its extrapolation from two shallow
traces gives the full trace's bytes: a Llama-2-7B-shaped and a Llama-3-70B-shaped config (bf16
weights, LoRA r=16, bf16+ckpt, batch 1 x 2,048 tokens), and the planner walking the ladder at
16 GiB for the 7B (LoRA) and a Qwen2-1.5B shape (full fine-tune), and where the 4-bit base is what
fits (the 7B LoRA at 12 GiB, the 70B LoRA at 80 GiB), each against one estimate of its own shape.

Each timing is one call in this process after a warm-up estimate of a tiny model (imports and
first-call caches paid there, as a notebook or a second CLI call pays them once), with the
estimator's build cache (the meta model and depth plan, kept per config and job) emptied first:
the plan builds its own, once for all its rungs; the process's own start (``import hf_memstack``,
PEFT) is printed apart.

    python bench/estimate_speed.py               # ~2 minutes on 2 CPU cores (the 7B full trace included)
    python bench/estimate_speed.py --full-70b    # also the 70B's full trace (minutes more)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

t_start = time.perf_counter()
import torch  # noqa: E402
from _common import LLAMA_SHAPES, machine  # noqa: E402
from transformers import LlamaConfig, Qwen2Config  # noqa: E402

from hf_memstack import estimate_memory, plan_policy  # noqa: E402
from hf_memstack.planning.estimate import build_cache as _build_cache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny Llama, for the warm-up
from tiny import llama_config  # noqa: E402

t_imports = time.perf_counter() - t_start

JOB = {"batch_size": 1, "seq_len": 2048, "trainable": {"r": 16}}
POLICY = "bf16+ckpt"


def config(shape: str) -> LlamaConfig:
    return LlamaConfig(**LLAMA_SHAPES[shape], max_position_embeddings=8192, dtype="bfloat16")


CPU: dict[str, float] = {}  # each timed call's CPU seconds (this process), by what it timed


def timed(fn, name: str = ""):
    """``fn()`` and its wall seconds; its CPU seconds go to ``CPU[name]`` (the 2 cores are shared with
    other jobs: CPU time is what the call itself costs, wall time adds what the others took)."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    CPU[name] = time.process_time() - cpu
    return out, time.perf_counter() - start


def fields(estimate) -> dict:
    values = dataclasses.asdict(estimate)
    values.pop("notes")
    return values


def qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )


def timed_plan(name: str, cfg, trainable, one: float, one_cpu: float, budget: str = "16GiB") -> dict:
    """The planner walking the ladder at ``budget`` (batch 1 x 2,048 tokens, cuda), against one estimate's
    wall (``one``) and CPU (``one_cpu``) seconds."""
    _build_cache.clear()  # the plan builds its model and depth plans itself, as a fresh `hf-memstack plan` does
    plan, t_plan = timed(
        lambda: plan_policy(cfg, budget=budget, seq_len=2048, trainable=trainable, device="cuda"), "plan"
    )
    cpu = CPU["plan"]
    traced, read = sum(r.traced for r in plan.rows), sum(r.interpolated for r in plan.rows)
    print(
        f"plan {name} at {budget} (cuda): {t_plan:.1f} s = {t_plan / one:.2f}x one estimate ({one:.1f} s); CPU {cpu:.1f} s = "
        f"{cpu / one_cpu:.2f}x one estimate's ({one_cpu:.1f} s), "
        f"{len(plan.rows)} rungs considered, {traced} traced, {read} read between their neighbours; "
        f"chose {plan.policy.to_string() if plan.fits else 'nothing'}"
    )
    print(plan.table())
    return {
        "budget": budget,
        "seconds": round(t_plan, 2),
        "one_estimate_seconds": round(one, 2),
        "x_one_estimate": round(t_plan / one, 2),
        "cpu_seconds": round(cpu, 2),
        "one_estimate_cpu_seconds": round(one_cpu, 2),
        "cpu_x_one_estimate": round(cpu / one_cpu, 2),
        "rungs": len(plan.rows),
        "traced": traced,
        "interpolated": read,
        "chose": plan.policy.to_string() if plan.fits else None,
        "rows": [(r.policy, r.peak_bytes, r.fits) for r in plan.rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full-70b", action="store_true", help="also trace the 70B's every block, to compare")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "estimate_speed.json"))
    args = ap.parse_args()
    print(machine(), f"torch threads {torch.get_num_threads()}", f"imports {t_imports:.1f} s", sep="\n")
    _, warm = timed(
        lambda: estimate_memory(llama_config(vocab_size=256), POLICY, batch_size=1, seq_len=32, trainable={"r": 16})
    )
    print(f"warm-up estimate (tiny model, first call): {warm:.1f} s")
    rows = []
    for shape in LLAMA_SHAPES:
        _build_cache.clear()  # each one estimate builds its model and depth plan itself
        fast, t_fast = timed(lambda shape=shape: estimate_memory(config(shape), POLICY, **JOB), shape)
        row = {
            "shape": shape,
            "seconds": round(t_fast, 2),
            "cpu_seconds": round(CPU[shape], 2),
            "peak_bytes": fast.peak_bytes,
            "notes": list(fast.notes),
        }
        if shape == "llama-2-7b":  # a second rung, whose peak sits elsewhere (no checkpointing)
            other = [estimate_memory(config(shape), "bf16+loss:chunked", **JOB, extrapolate=e) for e in (True, False)]
            row["bf16+loss:chunked_equal_to_full_trace"] = fields(other[0]) == fields(other[1])
            print(
                f"{shape} bf16+loss:chunked: every field equal to the full trace: {row['bf16+loss:chunked_equal_to_full_trace']}"
            )
        if shape == "llama-2-7b" or args.full_70b:
            full, t_full = timed(lambda shape=shape: estimate_memory(config(shape), POLICY, **JOB, extrapolate=False))
            diff = {k: (v, fields(full)[k]) for k, v in fields(fast).items() if fields(full)[k] != v}
            row |= {"full_trace_seconds": round(t_full, 2), "equal_to_full_trace": not diff, "differences": diff}
        rows.append(row)
        print(
            f"{shape}: {t_fast:.1f} s, peak {fast.peak_bytes / 2**30:.2f} GiB"
            + (
                f"; full trace {row['full_trace_seconds']:.1f} s, every field equal: {row['equal_to_full_trace']}"
                if "full_trace_seconds" in row
                else ""
            )
        )
    plans = {
        "llama-2-7b": timed_plan(
            "llama-2-7b LoRA", config("llama-2-7b"), {"r": 16}, rows[0]["seconds"], CPU["llama-2-7b"]
        )
    }
    # Where the 4-bit base is what fits: the 7B at 12 GiB, the 70B at 80 GiB (LoRA).
    plans["llama-2-7b-12gib"] = timed_plan(
        "llama-2-7b LoRA", config("llama-2-7b"), {"r": 16}, rows[0]["seconds"], CPU["llama-2-7b"], budget="12GiB"
    )
    plans["llama-3-70b-80gib"] = timed_plan(
        "llama-3-70b LoRA", config("llama-3-70b"), {"r": 16}, rows[1]["seconds"], CPU["llama-3-70b"], budget="80GiB"
    )
    # The full fine-tune of a Qwen2-1.5B shape (tied embeddings, vocab 151,936): its own one estimate first.
    _build_cache.clear()
    _, one = timed(lambda: estimate_memory(qwen2_config(), POLICY, batch_size=1, seq_len=2048), "qwen2-1.5b")
    print(f"qwen2-1.5b {POLICY} (full fine-tune): {one:.1f} s ({CPU['qwen2-1.5b']:.1f} s CPU)")
    plans["qwen2-1.5b"] = timed_plan("qwen2-1.5b full fine-tune", qwen2_config(), "all", one, CPU["qwen2-1.5b"])
    out = {
        "machine": machine(),
        "imports_seconds": round(t_imports, 2),
        "estimates": rows,
        "plan": plans["llama-2-7b"],
        "plans": plans,
    }
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
