"""Loss curves of the recipe's default job (real pretrained MiniLM-L6, topic classification) with
fp32 AdamW and with the optimizer rungs (8-bit moments, stepped in the backward), each over two
seeds, so that a rung's difference from AdamW can be read against AdamW's own seed-to-seed spread.

    python bench/optimizer_curves.py                 # 200 steps, seeds 0 and 1, four policies
    python bench/optimizer_curves.py --steps 40 --policies fp32,fp32+optim:in_backward
    python bench/optimizer_curves.py --policies bf16,bf16+weights:bf16,plain:bf16+weights:bf16 --base bf16

The master-weights rows: ``bf16`` (fp32 master weights, bf16 autocast), ``bf16+weights:bf16``
(pure bf16, torchao's AdamW with stochastic rounding) and ``plain:bf16+weights:bf16`` (the same
bf16 weights with plain ``torch.optim.AdamW``: bench/_plain_adamw.py), read against ``--base``.

Every run uses --grad-clip 0 (stepping in the backward cannot clip by the global norm) and the
same precision (fp32: the optimizer is what differs). Writes bench/results/optimizer_curves.json,
keeping the runs already there for other (policy, seed) pairs and the same step count, so that
runs can be added one at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _common import FINETUNE, ROOT, last_quarter_loss, machine, recipe_run, run_dir

POLICIES = ["fp32", "fp32+optim:in_backward", "fp32+optim:8bit", "fp32+optim:8bit+optim:in_backward"]


def run(policy: str, seed: int, steps: int, out: Path) -> dict:
    """``plain:``: bench/_plain_adamw.py (the recipe with plain AdamW) on the policy after the prefix."""
    script = ROOT / "bench" / "_plain_adamw.py" if policy.startswith("plain:") else FINETUNE
    return {**recipe_run(script, policy.removeprefix("plain:"), seed, steps, out, "--grad-clip", "0"), "policy": policy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--base", default="fp32", help="the policy the others are read against")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "optimizer_curves.json"))
    args = ap.parse_args()
    print(machine())
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    wanted = {(p, s) for p in args.policies.split(",") for s in seeds}
    kept = []
    if out.exists():
        old = json.loads(out.read_text())
        if old.get("steps") == args.steps:
            kept = [r for r in old["runs"] if (r["policy"], r["seed"]) not in wanted]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            for seed in seeds:
                r = run(policy, seed, args.steps, run_dir(tmp, policy, seed))
                print(f"  {policy} seed {seed}: {r['seconds']:.0f} s, final {r['final']}", flush=True)
                runs.append(r)
                # After every run (an hour each for bf16 on a CPU without it): what was measured is kept.
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({"machine": machine(), "steps": args.steps, "runs": kept + runs}, indent=2))

    runs = kept + runs
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    base = [last_quarter_loss(r) for r in runs if r["policy"] == args.base]
    spread = max(base) - min(base) if len(base) > 1 else float("nan")
    base_mean = statistics.fmean(base) if base else float("nan")  # nan: the base has no run in this file yet
    print(
        "\n| policy | seeds | train loss, last quarter (mean over seeds) | minus the base's | the base's seed spread | final eval loss | final accuracy | s/run |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for policy in policies:
        rs = [r for r in runs if r["policy"] == policy]
        t = statistics.fmean(last_quarter_loss(r) for r in rs)
        ev = statistics.fmean(r["final"].get("eval_loss", float("nan")) for r in rs)
        acc = statistics.fmean(r["final"].get("eval_accuracy", float("nan")) for r in rs)
        print(
            f"| {policy} | {len(rs)} | {t:.4f} | {t - base_mean:+.4f} | {spread:.4f} | {ev:.4f} | {acc:.3f} | "
            f"{statistics.fmean(r['seconds'] for r in rs):.0f} |"
        )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
