"""Ulysses sequence parallelism (``sp:2``) on 2 CPU processes (gloo), in one run: how long a row trains
under a per-rank memory budget, what the all-to-all costs in tokens/s, and whether the sharded step
computes the unsharded one.

    python bench/sequence_parallel.py                          # spawns its 2 gloo ranks (tests/dist_utils.py)
    python bench/sequence_parallel.py --headroom-mib 512 --granule 2 --speed-seq 4096 --runs 9   # bigger

1. **Longest row under a budget.** A Llama (hidden 256, 4 layers, 4 heads / 2 key/value heads, vocab
   8192) prepared with ``--policy`` (``bf16+ckpt+loss:chunked`` where the CPU has native bf16, else
   ``fp32+...``), once as ``sp:1`` (the 2 ranks data-parallel, one row each) and once with ``+sp:2``
   (one row, each rank half of it). The per-rank budget is the model's and AdamW's states at entry plus
   ``--headroom-mib`` - what :func:`hf_memstack.simulated_memory_limit` (the batch-size finder's
   simulated limit on CPU) is given. A training step (forward, backward, gradients averaged over the
   ranks, optimizer step; ``shard_batch`` / ``backward_loss`` / ``average_gradients`` under ``sp:2``) is
   searched over row length (doubling from ``--start``, then bisection on multiples of ``--granule``).
   Each probe runs the step under a non-refusing copy of that limit and reads its peak of live tensor
   bytes (the ranks agree on the larger): the limit refuses a step exactly when that peak exceeds the
   budget, and a probe refused on one rank only would leave its peer waiting in a collective. The
   longest length found is then run under the real limit on both ranks (no allocation refused). The
   limit sees each operator's outputs: inside the exchange (a custom op) the contiguous copy of q/k/v
   it sends is a transient it does not count (the op's output it does).
2. **Tokens/s** of ``sp:2`` against ``sp:1`` on the same 2 ranks and the same global batch: 2 rows of
   ``--speed-seq`` tokens (by default sp:1's longest row of part 1, which both fit), one row per rank
   for ``sp:1``, half of both rows per rank for ``sp:2``. The two steps run interleaved ``--runs``
   times (each first half the time); the ratio per pair, min/median/max.
3. **Parity**: the sharded step (``sp:2``; ``fp32+ckpt+loss:chunked``, then ``bf16+...``: its rounding)
   against the same step unsharded on each rank, for Llama (MHA), Qwen2, a GQA Llama, an MQA Llama
   (key/value heads repeated) and Mistral with ``sliding_window`` shorter than the row: |dloss| and the
   gradients' largest relative difference.

Ratios only (both sides measured in the same run, on the same ranks); the machine's load makes the
absolute seconds meaningless. One thread per rank. Results: ``bench/results/sequence_parallel.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import machine, reference_batch  # noqa: E402
from dist_utils import run_ranks  # noqa: E402

from hf_memstack.transforms.precision.apply import cpu_has_native_bf16  # noqa: E402

MIB = 2**20

# Parity cases: (architecture, config overrides). The row is --parity-seq tokens; Mistral's window is shorter.
PARITY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama (MHA, 4/4 heads)": ("llama", {"num_key_value_heads": 4}),
    "qwen2 (GQA, 4/2 heads)": ("qwen2", {"num_key_value_heads": 2}),
    "llama GQA (8/2 heads)": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "llama MQA (4/1 heads)": ("llama", {"num_key_value_heads": 1}),
    "mistral (window 64 < row)": ("mistral", {"num_key_value_heads": 2, "sliding_window": 64, "head_dim": 32}),
}


# -- the model and one training step -------------------------------------------------------------------
def bench_model(args: dict[str, Any], policy: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The Llama of part 1 and 2 (seed 0, the same on every rank), prepared with ``policy``, and its AdamW
    with its state already made (one step on a short row), so that the state counts at entry."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_memstack import make_optimizer, prepare_model

    cfg = LlamaConfig(
        hidden_size=args["hidden"],
        intermediate_size=int(args["hidden"] * 8 / 3) // 64 * 64,
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"],
        vocab_size=args["vocab"],
        max_position_embeddings=1 << 20,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = prepare_model(LlamaForCausalLM(cfg).train(), policy)
    optimizer = make_optimizer(model, lr=1e-5)
    train_step(model, optimizer, reference_batch(2, 64, args["vocab"]))
    return model, optimizer


def local_rows(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's part of the global ``rows``: under sp:N its slice of all of them, else its own row(s)."""
    import torch.distributed as dist

    from hf_memstack.transforms.sequence_parallel import sequence_parallel_size, shard_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    n = sequence_parallel_size(model)
    if n > 1:
        return shard_batch(rows, sp_rank=rank % n, sp_size=n)
    per = rows["input_ids"].shape[0] // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in rows.items()}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: dict[str, torch.Tensor]) -> None:
    """One step as the recipe runs it: this rank's part, N x its loss backpropagated, gradients averaged."""
    from hf_memstack.transforms.sequence_parallel import average_gradients, backward_loss

    loss = model(**local_rows(model, rows), use_cache=False).loss
    backward_loss(loss, model).backward()
    average_gradients(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# -- 1. the longest row under the budget ---------------------------------------------------------------
def step_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seq: int, args: dict[str, Any]) -> int:
    """The step's peak of live tensor bytes on the busier rank (the states at entry included) for one row
    of ``seq`` tokens (global: under sp:1 each rank has its own row)."""
    import torch.distributed as dist

    from hf_memstack import simulated_memory_limit

    world = dist.get_world_size()
    rows = reference_batch(1 if _sp(model) > 1 else world, seq, args["vocab"], seed=seq)
    with simulated_memory_limit(1 << 50, count=[model, optimizer]) as seen:  # counts, never refuses
        train_step(model, optimizer, rows)
    peak = torch.tensor([seen.peak_bytes], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def longest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, budget: int, args: dict[str, Any]) -> dict:
    """The longest row (a multiple of --granule) whose step's peak fits ``budget``, and every probe."""
    probes: dict[int, int] = {}

    def fits(seq: int) -> bool:
        start = time.perf_counter()
        probes[seq] = step_peak(model, optimizer, seq, args)
        _progress(
            f"sp:{_sp(model)} {seq} tokens: peak {probes[seq] / MIB:.1f} MiB ({time.perf_counter() - start:.1f} s)"
        )
        return probes[seq] <= budget

    g = args["granule"]
    lo, hi = 0, args["start"] // g * g
    while fits(hi):  # doubling
        lo, hi = hi, 2 * hi
        if hi > args["max_seq"]:
            raise SystemExit(f"a row of {hi} tokens still fits the budget: lower --headroom-mib or raise --max-seq")
    while hi - lo > g:  # bisection on multiples of the granule
        mid = (lo + hi) // 2 // g * g
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        raise SystemExit(f"not even {hi} tokens fit the budget: raise --headroom-mib or lower --start")
    return {"longest": lo, "first_refused": hi, "probes": {str(k): v for k, v in sorted(probes.items())}}


def confirm(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seq: int, budget: int, args: dict) -> dict:
    """The step at ``seq`` under the real limit of ``budget``: its peak and refused allocations (0), the
    larger of the ranks'."""
    import torch.distributed as dist

    from hf_memstack import simulated_memory_limit

    rows = reference_batch(1 if _sp(model) > 1 else dist.get_world_size(), seq, args["vocab"], seed=seq)
    with simulated_memory_limit(budget, count=[model, optimizer]) as limit:
        train_step(model, optimizer, rows)
    seen = torch.tensor([limit.peak_bytes, limit.out_of_memory_errors], dtype=torch.int64)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return {"seq": seq, "peak": int(seen[0]), "refused": int(seen[1])}


def memory_part(args: dict[str, Any], policy: str) -> dict[str, Any]:
    from hf_memstack import simulated_memory_limit

    out: dict[str, Any] = {}
    budget = None
    for name, spec in (("sp:1", policy), ("sp:2", f"{policy}+sp:2")):
        model, optimizer = bench_model(args, spec)
        with simulated_memory_limit(1 << 50, count=[model, optimizer]) as entry:
            pass
        if budget is None:  # the same budget for both: sp:1's states at entry + the headroom
            budget = entry.peak_bytes + args["headroom_mib"] * MIB
        found = longest(model, optimizer, budget, args)
        found["confirmed"] = confirm(model, optimizer, found["longest"], budget, args)
        out[name] = {"policy": spec, "states_at_entry": entry.peak_bytes, **found}
        if name == "sp:2":  # both at sp:1's longest row: what the step's activations (peak - states) come to
            same = out["sp:1"]["longest"]
            out["at_sp1_longest"] = {"seq": same, "sp:1": out["sp:1"]["confirmed"]["peak"]}
            out["at_sp1_longest"]["sp:2"] = step_peak(model, optimizer, same, args)
        del model, optimizer
    out["budget"] = budget
    out["ratio"] = out["sp:2"]["longest"] / out["sp:1"]["longest"]
    same, states = out["at_sp1_longest"], out["sp:1"]["states_at_entry"]
    same["activation_ratio"] = (same["sp:2"] - states) / (same["sp:1"] - states)
    return out


# -- 2. tokens/s ---------------------------------------------------------------------------------------
def speed_part(args: dict[str, Any], policy: str) -> dict[str, Any]:
    """sp:1 and sp:2 steps on the same global batch (2 rows of --speed-seq), interleaved; seconds per step
    from barrier to barrier (the slower rank's)."""
    import torch.distributed as dist

    models = {name: bench_model(args, spec) for name, spec in (("sp:1", policy), ("sp:2", f"{policy}+sp:2"))}
    rows = reference_batch(2, args["speed_seq"], args["vocab"], seed=7)
    for model, optimizer in models.values():  # warm-up, not timed
        train_step(model, optimizer, rows)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args["runs"]):
        for name in ("sp:1", "sp:2") if i % 2 == 0 else ("sp:2", "sp:1"):
            dist.barrier()
            start = time.perf_counter()
            train_step(*models[name], rows)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    tokens = 2 * args["speed_seq"]
    ratios = [a / b for a, b in zip(seconds["sp:1"], seconds["sp:2"])]  # tokens/s of sp:2 over sp:1's
    return {
        "seq": args["speed_seq"],
        "global_tokens_per_step": tokens,
        "seconds": seconds,
        "tokens_per_second_median": {k: tokens / statistics.median(v) for k, v in seconds.items()},
        "ratios": ratios,
        "ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)},
    }


# -- 3. parity -----------------------------------------------------------------------------------------
def parity_model(case: str, args: dict[str, Any]) -> torch.nn.Module:
    import transformers

    arch, overrides = PARITY[case]
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = config_class(**{**shape, **overrides}, vocab_size=1024, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_class(config).train()


def parity_case(case: str, policy: str, args: dict[str, Any]) -> dict[str, Any]:
    """The sharded step (this rank's slice, backward_loss, average_gradients, reported_loss) against the
    unsharded step on the whole rows in this process; |dloss| and the gradients' relative differences."""
    from hf_memstack import prepare_model
    from hf_memstack.transforms.sequence_parallel import average_gradients, backward_loss, reported_loss, shard_batch

    rows = reference_batch(2, args["parity_seq"], 1024, seed=3)
    rows["labels"][:, :5] = -100  # some unlabelled tokens: the loss is over the group's count, not a slice's
    sharded = prepare_model(parity_model(case, args), f"{policy}+sp:2")
    loss = sharded(**local_rows(sharded, rows), use_cache=False).loss
    backward_loss(loss, sharded).backward()
    average_gradients(sharded)
    got = float(reported_loss(loss, sharded))
    reference = prepare_model(parity_model(case, args), policy)
    ref_loss = reference(**shard_batch(rows, sp_rank=0, sp_size=1), use_cache=False).loss
    ref_loss.backward()
    pairs = [(a.grad.float(), b.grad.float()) for a, b in zip(sharded.parameters(), reference.parameters())]
    scale = max(float(r.abs().max()) for _, r in pairs)
    return {
        "loss": got,
        "reference_loss": float(ref_loss),
        "dloss": abs(got - float(ref_loss)),
        "dgrad_over_max_grad": max(float((g - r).abs().max()) for g, r in pairs) / scale,
        "dgrad_per_tensor_max": max(float((g - r).abs().max()) / max(float(r.abs().max()), 1e-30) for g, r in pairs),
        "tensors": len(pairs),
    }


# -- the ranks and the report --------------------------------------------------------------------------
def _sp(model: torch.nn.Module) -> int:
    from hf_memstack.transforms.sequence_parallel import sequence_parallel_size

    return sequence_parallel_size(model)


def _progress(line: str) -> None:
    """A line on rank 0's stderr as the run goes (the ranks' results are printed at the end)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import warnings

    torch.set_num_threads(1)  # 2 ranks on the machine's cores
    warnings.filterwarnings("ignore")
    out: dict[str, Any] = {}
    if "memory" in args["parts"]:
        out["memory"] = memory_part(args, args["policy"])
    if "speed" in args["parts"]:
        if not args["speed_seq"]:  # a length both fit: sp:1's longest under the budget
            args = {**args, "speed_seq": out["memory"]["sp:1"]["longest"] if "memory" in out else 2048}
        out["speed"] = speed_part(args, args["policy"])
    if "parity" in args["parts"]:
        out["parity"] = {p: {case: parity_case(case, p, args) for case in PARITY} for p in args["parity_policies"]}
    return out


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    if "memory" in result:
        m = result["memory"]
        print(
            f"\n1. Longest row that trains under {m['budget'] / MIB:.0f} MiB per rank (states + {args.headroom_mib} MiB)"
        )
        print("| policy | states at entry MiB | longest row | first refused | peak at the longest MiB | refused |")
        print("|---|---|---|---|---|---|")
        for name in ("sp:1", "sp:2"):
            r = m[name]
            print(
                f"| {r['policy']} | {r['states_at_entry'] / MIB:.1f} | {r['longest']} | {r['first_refused']} | "
                f"{r['confirmed']['peak'] / MIB:.1f} | {r['confirmed']['refused']} |"
            )
        same = m["at_sp1_longest"]
        print(
            f"sp:2 / sp:1 longest row: {m['ratio']:.2f}x; at {same['seq']} tokens the peak is {same['sp:1'] / MIB:.1f} -> "
            f"{same['sp:2'] / MIB:.1f} MiB per rank, its part above the states {same['activation_ratio']:.2f}x"
        )
    if "speed" in result:
        s = result["speed"]
        print(f"\n2. Tokens/s, 2 rows x {s['seq']} tokens per step, {args.runs} interleaved pairs")
        tps = s["tokens_per_second_median"]
        print(
            f"sp:2 / sp:1 tokens/s: median {s['ratio']['median']:.2f} (min {s['ratio']['min']:.2f}, max "
            f"{s['ratio']['max']:.2f}); medians {tps['sp:1']:.0f} and {tps['sp:2']:.0f} tokens/s (this load only)"
        )
    for policy, cases in result.get("parity", {}).items():
        print(f"\n3. Parity, {policy}+sp:2 against the unsharded step, 2 rows x {args.parity_seq} tokens")
        print("| model | loss | abs dloss | max abs dgrad / max abs grad | largest per-tensor relative dgrad |")
        print("|---|---|---|---|---|")
        for case, r in cases.items():
            print(
                f"| {case} | {r['reference_loss']:.4f} | {r['dloss']:.1e} | {r['dgrad_over_max_grad']:.1e} | "
                f"{r['dgrad_per_tensor_max']:.1e} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default=None, help="default: bf16+ckpt+loss:chunked with native bf16, else fp32+...")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--headroom-mib", type=int, default=128, help="the budget per rank: states at entry + this")
    ap.add_argument("--start", type=int, default=1024, help="the search's first row length")
    ap.add_argument("--granule", type=int, default=16, help="row lengths searched: multiples of this (even)")
    ap.add_argument("--max-seq", type=int, default=1 << 17)
    ap.add_argument("--speed-seq", type=int, default=0, help="0: sp:1's longest row of part 1 (else 2048)")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--parity-seq", type=int, default=256)
    ap.add_argument("--parity-policies", nargs="+", default=["fp32+ckpt+loss:chunked", "bf16+ckpt+loss:chunked"])
    ap.add_argument("--parts", nargs="+", default=["memory", "speed", "parity"], choices=["memory", "speed", "parity"])
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before the ranks are killed")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "sequence_parallel.json"))
    args = ap.parse_args()
    if args.granule < 2 or args.granule % 2:
        ap.error(f"--granule {args.granule}: must be an even number of tokens (sp:2 halves every row)")
    native = cpu_has_native_bf16()
    args.policy = args.policy or ("bf16" if native else "fp32") + "+ckpt+loss:chunked"
    print(f"machine: {machine()}; native bf16: {'yes' if native else 'no'}; policy {args.policy}; 2 gloo ranks")
    start = time.perf_counter()
    ranks = run_ranks(_rank, vars(args), world=2, timeout=args.timeout, group_timeout=600)
    result = ranks[0]
    report(result, args)
    wall = time.perf_counter() - start
    print(f"\n({wall:.0f} s; a shared machine: the tokens/s ratio is noisy, the memory figures are not)")
    payload = {"machine": machine(), "native_bf16": native, "args": vars(args), "wall_seconds": wall, **result}
    payload["rank1_parity"] = ranks[1].get("parity")
    Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
