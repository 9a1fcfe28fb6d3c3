"""FSDP2 on 2 CPU processes (gloo), in one run: what each rank holds.

1. Loading: every rank calling ``from_pretrained`` against ``from_pretrained_for_fsdp`` (rank 0
   reads the weights; the others build on the meta device and get their shards by broadcast).
   Per rank: the peak resident-memory growth (ru_maxrss) from before loading to after sharding,
   and the wall time.
2. One training step per policy, measured by the meter on each rank: parameters, gradients and
   optimizer state per rank against one unsharded process, and the step's peak.

    python bench/fsdp.py                       # Llama 8 layers, h=1024, vocab 32000 (~170M params)
    python bench/fsdp.py --layers 4 --hidden 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from _common import machine, reference_batch, reference_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_utils import run_ranks  # noqa: E402

POLICIES = ("fp32+fsdp", "bf16+fsdp", "bf16+ckpt+fsdp")


def _rank(rank: int, world: int, job: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_memstack import measure_step, prepare_model
    from hf_memstack.distributed import from_pretrained_for_fsdp
    from hf_memstack.measure import model_state_bytes

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    # ru_maxrss survives exec (a spawned child starts with its parent's peak): reset the kernel's
    # high-water mark (VmHWM) instead and read it back after sharding.
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_bytes("VmRSS")
    start = time.perf_counter()
    if job["load"] == "rank 0 + broadcast":
        model = from_pretrained_for_fsdp(AutoModelForCausalLM, job["model_dir"], dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    model = prepare_model(model.train(), job["policy"])
    torch.distributed.barrier()
    result = {
        "load_seconds": time.perf_counter() - start,
        "load_peak_rss_growth": _status_bytes("VmHWM") - before,
        "rss_after": _status_bytes("VmRSS") - before,
    }
    if job.get("step"):
        per = job["batch"] // world
        batch = {
            k: v[rank * per : (rank + 1) * per]
            for k, v in reference_batch(job["batch"], job["seq"], job["vocab"]).items()
        }
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        m = measure_step(model, batch, opt, timed=True)
        result.update(
            dataclasses.asdict(model_state_bytes(model, opt)),
            peak=m.peak_bytes,
            peak_phase=m.peak_phase,
            saved_activations=m.saved_activations,
            step_seconds=m.step_seconds,
        )
    return result


def _status_bytes(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _run(job: dict) -> list[dict]:
    # The tests' launcher: a gloo group with a timeout on every collective and a deadline on the run.
    return run_ranks(_rank, job, world=2, timeout=900)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over the 2 ranks)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "fsdp.json"))
    args = ap.parse_args()
    from hf_memstack import format_bytes, measure_step, prepare_model
    from hf_memstack.measure import model_state_bytes

    rows: dict = {"machine": machine(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        model = reference_model(args.layers, args.hidden, args.vocab)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        # The unsharded reference: one process, the same global batch.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        alone = {}
        for policy in POLICIES:
            m = reference_model(args.layers, args.hidden, args.vocab)
            m = prepare_model(m, policy.replace("+fsdp", ""))
            o = torch.optim.AdamW(m.parameters(), lr=1e-4)
            s = measure_step(m, reference_batch(args.batch, args.seq, args.vocab), o, timed=False)
            alone[policy] = {
                **dataclasses.asdict(model_state_bytes(m, o)),
                "peak": s.peak_bytes,
                "saved_activations": s.saved_activations,
            }
        del model, opt

        print(
            f"{machine()}\nLlama {args.layers} layers, h={args.hidden}, vocab {args.vocab}: {n_params / 1e6:.0f}M parameters "
            f"({format_bytes(4 * n_params)} fp32); 2 ranks, global batch {args.batch} x seq {args.seq}\n"
        )
        print("| loading | rank | peak RSS growth, load + shard | RSS growth after | seconds |\n|---|---|---|---|---|")
        rows["loading"] = {}
        for load in ("every rank from_pretrained", "rank 0 + broadcast"):
            ranks = _run({"load": load, "model_dir": tmp, "policy": "fp32+fsdp"})
            rows["loading"][load] = ranks
            for r, res in enumerate(ranks):
                print(
                    f"| {load} | {r} | {format_bytes(res['load_peak_rss_growth'])} | {format_bytes(res['rss_after'])} | {res['load_seconds']:.1f} |"
                )

        print(
            "\n| policy | params+grads+optimizer per rank | vs one process | activations after forward per rank | step peak per rank (phase) | vs one process |\n|---|---|---|---|---|---|"
        )
        rows["steps"] = {}
        for policy in POLICIES:
            ranks = _run(
                {
                    "load": "rank 0 + broadcast",
                    "model_dir": tmp,
                    "policy": policy,
                    "step": True,
                    "batch": args.batch,
                    "seq": args.seq,
                    "vocab": args.vocab,
                }
            )
            rows["steps"][policy] = {"ranks": ranks, "one_process": alone[policy]}
            r0, a = ranks[0], alone[policy]
            states, states_alone = (
                (r0["parameters"] + r0["gradients"] + r0["optimizer"]),
                (a["parameters"] + a["gradients"] + a["optimizer"]),
            )
            print(
                f"| {policy} | {format_bytes(states)} | {states / states_alone:.2f} | {format_bytes(r0['saved_activations'])} | {format_bytes(r0['peak'])} ({r0['peak_phase']}) | {r0['peak'] / a['peak']:.2f} |"
            )
    out = Path(args.out)
    out.write_text(json.dumps(rows, indent=2))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
