"""The ladder benchmark: step time, peak memory, activations, model-state bytes and backward FLOPs
per rung, for hf_memstack's prepare_model / make_optimizer and the same rung hand-written in plain
PyTorch/Transformers/torchao calls - measured side by side, interleaved, in one run - plus
full-model vs regional compile time, a large-vocabulary model, and the loss-head implementations.

    python bench/ladder.py                      # the ladder model: 4-layer Llama h=1024, vocab 32k, batch 4, seq 256
    python bench/ladder.py --model large-vocab  # vocab 128,256, hidden 1024, 4 layers, batch 4, seq 512
    python bench/ladder.py --head               # the loss head alone: plain, F.linear_cross_entropy, chunks
    python bench/ladder.py --model large-vocab --batch 8 --pair bf16+ckpt,bf16+ckpt+loss:chunked --steps 3
                                                # two rungs' step times, interleaved pair by pair
    python bench/ladder.py --layers 2 --hidden 256 --seq 128 --steps 6 --compile-layers 0   # a quick look

Speed: ``--steps`` interleaved pairs per rung (ours, hand; each side first half the time); the
ours/hand column is the median of the per-pair ratios, with their interquartile range and the
95% interval of the mean of the log-ratios (so a 2% difference can be told from this machine's
noise). Writes bench/results/ladder*.json and, with matplotlib, bench/results/ladder.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from pathlib import Path

import torch
from _common import machine, median, reference_batch, reference_model, timed

from hf_memstack import make_optimizer, measure_step, prepare_model, verify
from hf_memstack.measure import model_state_bytes, train_step
from hf_memstack.measure.accounting import optimizer_state_bytes
from hf_memstack.transforms.precision.apply import cpu_has_native_bf16

RUNGS = [
    "fp32",
    "bf16",
    "bf16+ckpt:2",
    "bf16+ckpt",
    "bf16+compile",
    "bf16+compile+ckpt",
    "bf16+compile:regional+ckpt",
    "bf16+loss:chunked",
    "bf16+ckpt:selective",
    "bf16+ckpt:selective:alternate",
    "bf16+ckpt+loss:chunked",
    "bf16+ckpt:selective+loss:chunked",
    "bf16+ckpt:selective:alternate+loss:chunked",
    "bf16+compile+ckpt+loss:chunked",
    "bf16+ckpt+loss:chunked+optim:in_backward",
    "bf16+ckpt+loss:chunked+optim:8bit",
    "bf16+ckpt+loss:chunked+optim:8bit+optim:in_backward",
]
LARGE_VOCAB_RUNGS = ["bf16", "bf16+loss:chunked", "bf16+ckpt", "bf16+ckpt+loss:chunked"]
MODELS = {
    "ladder": {"layers": 4, "hidden": 1024, "vocab": 32000, "batch": 4, "seq": 256},
    "large-vocab": {"layers": 4, "hidden": 1024, "vocab": 128256, "batch": 4, "seq": 512},
}


# --------------------------------------------------------------------------- the hand-written side
def _hand_sac_context() -> tuple:
    """Selective checkpointing as a user writes it from PyTorch's docs: save matmuls and attention."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    alternate = getattr(_hand_sac_context, "alternate", False)
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            key = "recompute" if ctx.is_recompute else "forward"
            count[key] += 1
            if alternate and count[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _hand_sac_alternate() -> tuple:
    _hand_sac_context.alternate = True  # type: ignore[attr-defined]
    try:
        return _hand_sac_context()
    finally:
        _hand_sac_context.alternate = False  # type: ignore[attr-defined]


def hand_prepare(model: torch.nn.Module, rung: str) -> torch.nn.Module:
    """The same rung written by hand with Transformers and PyTorch calls."""
    parts = rung.split("+")
    ckpt = next((p for p in parts if p.startswith("ckpt")), None)
    if ckpt:
        kwargs: dict = {"use_reentrant": False}
        every = 1
        if ckpt.startswith("ckpt:selective"):
            kwargs["context_fn"] = _hand_sac_alternate if ckpt.endswith("alternate") else _hand_sac_context
        elif ":" in ckpt:
            every = int(ckpt.split(":")[1])
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    if "loss:chunked" in parts:
        model.forward = functools.partial(_hand_chunked_forward, model)  # type: ignore[method-assign]
    if "compile" in parts:
        model.compile()
    elif "compile:regional" in parts:
        for layer in model.model.layers:
            layer.compile()
    return model


def _hand_chunked_forward(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """The chunked loss called directly (the function hf_memstack's wrapper calls), without the wrapper."""
    from hf_memstack.transforms.loss_head.chunked import auto_chunk_tokens, chunked_lm_loss

    hidden = model.model(input_ids=input_ids).last_hidden_state
    head = model.lm_head
    return {"loss": chunked_lm_loss(hidden, head, labels=labels, chunk_tokens=auto_chunk_tokens(head.out_features))}


def hand_optimizer(model: torch.nn.Module, rung: str) -> torch.optim.Optimizer | None:
    """torchao's AdamW8bit as its README shows; optimizer-in-backward as torchtune writes it."""
    params = [p for p in model.parameters() if p.requires_grad]
    if "optim:8bit" in rung:
        from torchao.optim import AdamW8bit

        make = lambda ps: AdamW8bit(ps, lr=1e-5)  # noqa: E731
    else:
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-5)  # noqa: E731
    if "optim:in_backward" not in rung:
        return make(params)
    optimizers = {p: make([p]) for p in params}

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in params:
        p.register_post_accumulate_grad_hook(step)
    model._hand_optimizers = optimizers  # type: ignore[attr-defined]  # keep them alive
    return None


def _eager_step(
    model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer | None, rung: str, device: str
) -> float:
    # Under the meter's dispatch mode dynamo refuses to compile torchao's step (hf_memstack's
    # AdamW8bit runs it eagerly there for the same reason): do the same for the hand-written one.
    with torch.compiler.set_stance("force_eager"):
        return hand_step(model, batch, opt, rung, device)


class _States(torch.optim.Optimizer):
    """Only the state of per-parameter optimizers, for the memory meter to count."""

    def __init__(self, optimizers: dict) -> None:  # noqa: D107 - no Optimizer.__init__: nothing to optimize
        self.state = {p: o.state[p] for p, o in optimizers.items()}
        self.param_groups = []


def hand_step(model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer | None, rung: str, device: str) -> float:
    with torch.autocast(device, dtype=torch.bfloat16, enabled=rung.startswith("bf16")):
        loss = model(**batch)["loss"]
    loss.float().backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


# ------------------------------------------------------------------------------------ one rung
def run_rung(rung: str, shape: dict, args: argparse.Namespace, device: str) -> dict:
    torch._dynamo.reset()
    batch = reference_batch(shape["batch"], shape["seq"], vocab=shape["vocab"], device=device)
    ours = reference_model(shape["layers"], shape["hidden"], vocab=shape["vocab"]).to(device)
    start = time.perf_counter()
    prepare_model(ours, rung)
    prepare_s = time.perf_counter() - start
    opt_ours = make_optimizer(ours, lr=1e-5)
    report = verify(ours, batch)
    hand = hand_prepare(reference_model(shape["layers"], shape["hidden"], vocab=shape["vocab"]).to(device), rung)
    opt_hand = hand_optimizer(hand, rung)
    step_ours = lambda: train_step(ours, batch, opt_ours)  # noqa: E731
    step_hand = lambda: hand_step(hand, batch, opt_hand, rung, device)  # noqa: E731
    first_ours = timed(step_ours, device)  # includes compile
    first_hand = timed(step_hand, device)
    times_ours, times_hand = interleaved_times(step_ours, step_hand, args.steps, device)
    grads = peak_live_gradients(ours, lambda: train_step(ours, batch, opt_ours))
    mem_ours = measure_step(ours, batch, opt_ours, timed=False)
    # The hand-written optimizer-in-backward has no optimizer object: show the meter its state.
    tracked_hand = opt_hand if opt_hand is not None else _States(getattr(hand, "_hand_optimizers", {}))
    mem_hand = measure_step(
        hand, batch, tracked_hand, timed=False, step_fn=lambda m, b, o: _eager_step(hand, b, opt_hand, rung, device)
    )
    # Model states: parameters, the most gradient bytes alive at once, and the optimizer's state.
    states = model_state_bytes(ours).parameters + grads + optimizer_state_bytes(opt_ours)
    return {
        "rung": rung,
        "prepare_s": prepare_s,
        "verify_ok": report.ok,
        "verify": str(report),
        "first_step_s": first_ours,
        "first_step_hand_s": first_hand,
        "step_times": times_ours,
        "step_times_hand": times_hand,
        "step_s": median(times_ours),
        "step_hand_s": median(times_hand),
        "peak_bytes": mem_ours.peak_bytes,
        "peak_hand_bytes": mem_hand.peak_bytes,
        "peak_phase": mem_ours.peak_phase,
        "activation_bytes": mem_ours.saved_activations,
        "model_state_bytes": states,
        "peak_gradient_bytes": grads,
        "optimizer_state_bytes": optimizer_state_bytes(opt_ours),
        "forward_flops": report.forward_flops,
        "backward_flops": report.backward_flops,
        "recompute_flops": report.recompute_flops,
        "parameter_bytes": model_state_bytes(ours).parameters,
    }


def interleaved_times(step_a, step_b, steps: int, device: str) -> tuple[list[float], list[float]]:
    """``steps`` timed pairs of two steps, each side first half the time: drift and cache effects
    hit both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            times[k].append(timed((step_a, step_b)[k], device))
    return times


def pair_comparison(rungs: list[str], shape: dict, args: argparse.Namespace, device: str) -> dict:
    """Step times of two rungs (both prepared by hf_memstack), interleaved step by step, each first
    half the time: the ratio is measured under the same conditions, unlike rungs run one after another."""
    a_rung, b_rung = rungs
    batch = reference_batch(shape["batch"], shape["seq"], vocab=shape["vocab"], device=device)
    steps = []
    for rung in rungs:
        model = prepare_model(reference_model(shape["layers"], shape["hidden"], vocab=shape["vocab"]).to(device), rung)
        opt = make_optimizer(model, lr=1e-5)
        steps.append(functools.partial(train_step, model, batch, opt))
        timed(steps[-1], device)  # warm-up
    times = interleaved_times(steps[0], steps[1], args.steps, device)
    stats = ratio_stats(times[0], times[1])  # B's time over A's, pair by pair: < 1 means B is faster
    print(f"\nmachine: {machine()}; {shape}; {args.steps} interleaved pairs")
    print(f"{a_rung}: {spread(times[0])} s;  {b_rung}: {spread(times[1])} s")
    print(f"step time {b_rung} / {a_rung}: {stats['gmean']:.3f} (95% CI {stats['ci95'][0]:.3f}-{stats['ci95'][1]:.3f})")
    return {
        "rungs": rungs,
        "step_times": {a_rung: times[0], b_rung: times[1]},
        "b_over_a_time": stats["gmean"],
        "ci95": list(stats["ci95"]),
    }


def peak_live_gradients(model: torch.nn.Module, step) -> int:
    """The most gradient bytes alive at once during ``step()``: each gradient counts from when it is
    computed until it is freed (by an optimizer stepping in the backward, or by zero_grad)."""
    live = peak = 0

    def computed(grad: torch.Tensor) -> None:
        nonlocal live, peak
        live += grad.numel() * grad.element_size()
        peak = max(peak, live)

    def accumulated(p: torch.Tensor) -> None:
        nonlocal live
        if p.grad is None:  # used and freed by the optimizer's own hook, registered before this one
            live -= p.numel() * p.element_size()

    params = [p for p in model.parameters() if p.requires_grad]
    handles = [
        h for p in params for h in (p.register_hook(computed), p.register_post_accumulate_grad_hook(accumulated))
    ]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return peak


def ratio_stats(ours: list[float], hand: list[float]) -> dict:
    """hand/ours per interleaved pair: median, interquartile range, and the 95% interval of the geometric mean."""
    ratios = [h / o for o, h in zip(ours, hand)]
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "median": statistics.median(ratios),
        "q1": q[0],
        "q3": q[2],
        "gmean": math.exp(mean),
        "ci95": (math.exp(mean - half), math.exp(mean + half)),
    }


def spread(times: list[float]) -> str:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return f"{statistics.median(times):.3f} [{q[0]:.3f}-{q[2]:.3f}]"


def compile_times(shape: dict, args: argparse.Namespace, device: str) -> dict:
    """First-step time minus a steady step: the compile cost of whole-model vs regional compile."""
    out = {}
    batch = reference_batch(shape["batch"], shape["seq"], vocab=shape["vocab"], device=device)
    for mode in ("compile", "compile:regional"):
        torch._dynamo.reset()
        model = prepare_model(
            reference_model(args.compile_layers, shape["hidden"], vocab=shape["vocab"]).to(device), f"bf16+{mode}"
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        step = functools.partial(train_step, model, batch, opt)
        # Cold compiles: with Inductor's on-disk caches warm (from the rungs above or an earlier
        # run) a regional compile took 0.06 s of backend time and the ratio meant nothing.
        with torch._inductor.config.patch(force_disable_caches=True):
            first = timed(step, device)
        steady = median([timed(step, device) for _ in range(2)])
        out[mode] = {
            "first_step_s": first,
            "steady_step_s": steady,
            "compile_s": first - steady,
            "backend_compile_s": model.memstack.compile.compile_seconds,
        }
    return out


def print_table(rows: list[dict], shape: dict, args: argparse.Namespace, params: int) -> None:
    base = next((r for r in rows if r["rung"] == "fp32"), rows[0])
    bf16 = next((r for r in rows if r["rung"] == "bf16"), base)
    print(f"\nmachine: {machine()}; native bf16: {cpu_has_native_bf16()}")
    print(
        f"model: Llama {shape['layers']} layers, hidden {shape['hidden']}, vocabulary {shape['vocab']}, {params / 1e6:.1f}M params; "
        f"batch {shape['batch']}, seq {shape['seq']}; {args.steps} interleaved steps per rung and side\n"
    )
    print(
        "| rung | step s, median [IQR] | speed vs fp32 | peak MiB | activations after forward MiB (vs bf16) | model states MiB "
        "| backward FLOPs vs bf16 | ours/hand speed, median [IQR] (95% CI) | ours/hand peak | verify |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = ratio_stats(r["step_times"], r["step_times_hand"])
        flops = r["backward_flops"] / bf16["backward_flops"] - 1 if bf16.get("backward_flops") else float("nan")
        print(
            f"| {r['rung']} | {spread(r['step_times'])} | {base['step_s'] / r['step_s']:.2f}x | {r['peak_bytes'] / 2**20:.0f} | "
            f"{r['activation_bytes'] / 2**20:.0f} ({r['activation_bytes'] / bf16['activation_bytes']:.2f}) | "
            f"{r['model_state_bytes'] / 2**20:.0f} | {flops:+.1%} | {s['median']:.3f} [{s['q1']:.3f}-{s['q3']:.3f}] "
            f"({s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}) | {r['peak_bytes'] / r['peak_hand_bytes']:.3f} | "
            f"{'ok' if r['verify_ok'] else 'FAIL'} |"
        )


def print_targets(rows: list[dict]) -> None:
    by = {r["rung"]: r for r in rows}

    def rel(a: str, b: str, key: str) -> float | None:
        return by[a][key] / by[b][key] if a in by and b in by and by[b][key] else None

    lines = [
        (
            "activations after forward, bf16+ckpt+loss:chunked / bf16 (target <= 0.30)",
            rel("bf16+ckpt+loss:chunked", "bf16", "activation_bytes"),
        ),
        ("activations after forward, bf16+ckpt / bf16", rel("bf16+ckpt", "bf16", "activation_bytes")),
    ]
    for sel in ("bf16+ckpt:selective", "bf16+ckpt:selective:alternate"):
        for suffix, base in (("", "bf16"), ("+loss:chunked", "bf16+loss:chunked")):
            if sel + suffix in by and base in by:
                r, b = by[sel + suffix], by[base]
                lines.append(
                    (
                        f"{sel}{suffix} vs {base}: backward FLOPs (target <= +15%)",
                        r["backward_flops"] / b["backward_flops"],
                    )
                )
                lines.append(
                    (
                        f"{sel}{suffix} vs {base}: activations saved (target >= 40%)",
                        1 - r["activation_bytes"] / b["activation_bytes"],
                    )
                )
    if "bf16+ckpt" in by:
        lines.append(("backward FLOPs, bf16+ckpt vs bf16", rel("bf16+ckpt", "bf16", "backward_flops")))
    for opt in (
        "bf16+ckpt+loss:chunked+optim:8bit+optim:in_backward",
        "bf16+ckpt+loss:chunked+optim:8bit",
        "bf16+ckpt+loss:chunked+optim:in_backward",
    ):
        lines.append(
            (
                f"model states at the peak, {opt} / bf16+ckpt+loss:chunked (target <= 0.45 for both)",
                rel(opt, "bf16+ckpt+loss:chunked", "model_state_bytes"),
            )
        )
    print()
    for text, value in lines:
        if value is not None:
            print(f"* {text}: {value:.3f}")


def large_vocab_summary(rows: list[dict]) -> None:
    by = {r["rung"]: r for r in rows}
    if "bf16+ckpt" in by and "bf16+ckpt+loss:chunked" in by:
        a, b = by["bf16+ckpt"], by["bf16+ckpt+loss:chunked"]
        print(
            f"\n* bf16+ckpt+loss:chunked vs bf16+ckpt: peak {b['peak_bytes'] / a['peak_bytes'] - 1:+.1%} (target <= -30%), "
            f"step time {b['step_s'] / a['step_s'] - 1:+.1%} (target <= +10%; medians of interleaved runs of both rungs below)"
        )


# ------------------------------------------------------------------------------ loss head alone
def head_comparison(args: argparse.Namespace) -> dict:
    """The head and loss alone (hidden states in, loss and gradients out), bf16 autocast: the
    plain head + Transformers-style fp32 loss, PyTorch's F.linear_cross_entropy (chunked),
    checkpointed chunks, and hf_memstack's fused chunks - interleaved, with their peaks."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from hf_memstack.measure.tracker import _frozen_aware_tracker  # the meter's tracker, for a bare function
    from hf_memstack.transforms.loss_head.chunked import auto_chunk_tokens, chunked_lm_loss

    n, h, v = args.head_tokens, 1024, 128256
    torch.manual_seed(0)
    head = torch.nn.Linear(h, v, bias=False)
    head.weight.data.mul_(0.02)
    hidden0 = torch.randn(n, h)
    target = torch.randint(0, v, (n,))
    chunk = auto_chunk_tokens(v)

    def plain(x):
        with torch.autocast("cpu", torch.bfloat16):
            logits = head(x)
        return F.cross_entropy(logits.float(), target)

    def torch_lce(x):
        with torch.autocast("cpu", torch.bfloat16):
            w, xb = head.weight.to(torch.bfloat16), x.to(torch.bfloat16)
        return F.linear_cross_entropy(
            xb, w, target, options=torch.nn.LinearCrossEntropyOptions()
        )  # its loss comes back in bf16

    def checkpointed(x):
        def piece(xc, yc):
            with torch.autocast("cpu", torch.bfloat16):
                logits = head(xc)
            return F.cross_entropy(logits.float(), yc, reduction="sum")

        total = sum(
            checkpoint(piece, x[s : s + chunk], target[s : s + chunk], use_reentrant=False) for s in range(0, n, chunk)
        )
        return total / n

    def fused(x):
        with torch.autocast("cpu", torch.bfloat16):
            return chunked_lm_loss(x.unsqueeze(0), head, shift_labels=target.unsqueeze(0), chunk_tokens=chunk)

    fns = {
        "plain head + fp32 loss": plain,
        "torch F.linear_cross_entropy": torch_lce,
        "checkpointed chunks": checkpointed,
        "hf_memstack fused chunks": fused,
    }
    out = {}
    for name, fn in fns.items():
        x = hidden0.clone().requires_grad_(True)
        head.weight.grad = None
        tracker = _frozen_aware_tracker()
        call = _Call(fn, head)  # inside a module, as in a model: the tracker accepts the head called per chunk
        tracker.track_external(call)
        with tracker:
            loss = call(x)
            loss.backward()
        peak = sum(
            int(val)
            for dev in tracker.get_tracker_snapshot("peak").values()
            for k, val in dev.items()
            if "Total" in str(k)
        )
        out[name] = {"loss": float(loss.detach()), "loss_dtype": str(loss.dtype), "peak_bytes": peak, "times": []}
    for _ in range(args.head_steps):
        for name, fn in fns.items():
            x = hidden0.clone().requires_grad_(True)
            head.weight.grad = None
            out[name]["times"].append(timed(lambda fn=fn, x=x: fn(x).backward(), "cpu"))
    ref = out["plain head + fp32 loss"]
    print(
        f"\nloss head alone: {n} tokens, hidden {h}, vocabulary {v}, bf16 autocast, chunks of {chunk} tokens; "
        f"{args.head_steps} interleaved runs; peak includes the fp32 weight and its gradient ({2 * h * v * 4 / 2**20:.0f} MiB)\n"
    )
    print("| implementation | forward+backward s, median [IQR] | time vs plain | peak MiB | loss (dtype) |")
    print("|---|---|---|---|---|")
    for name, r in out.items():
        print(
            f"| {name} | {spread(r['times'])} | {median(r['times']) / median(ref['times']):.2f}x | {r['peak_bytes'] / 2**20:.0f} | "
            f"{r['loss']:.4f} ({r['loss_dtype']}) |"
        )
    return {"tokens": n, "hidden": h, "vocab": v, "chunk_tokens": chunk, "results": out}


class _Call(torch.nn.Module):
    def __init__(self, fn, head: torch.nn.Module) -> None:
        super().__init__()
        self.fn, self.head = fn, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="ladder")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument(
        "--steps", type=int, default=20, help="interleaved timed steps per rung and side (after one warm-up step)"
    )
    ap.add_argument(
        "--compile-layers", type=int, default=8, help="depth of the model for full vs regional compile time (0 skips)"
    )
    ap.add_argument("--rungs", help="comma-separated rungs (default: the model's list)")
    ap.add_argument("--head", action="store_true", help="only compare the loss-head implementations")
    ap.add_argument("--pair", help="A,B: only compare two rungs' step times (ours), interleaved step by step")
    ap.add_argument("--head-tokens", type=int, default=2048)
    ap.add_argument("--head-steps", type=int, default=3)
    ap.add_argument("--out", help="JSON output (default bench/results/ladder[_large_vocab|_head].json)")
    args = ap.parse_args()
    results = Path(__file__).parent / "results"
    if args.head:
        out = Path(args.out or results / "ladder_head.json")
        out.write_text(json.dumps({"machine": machine(), "args": vars(args), **head_comparison(args)}, indent=2))
        print(f"\nwrote {out}")
        return
    shape = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in MODELS[args.model].items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.pair:
        out = Path(args.out or results / f"ladder_pair_{args.model}.json")
        out.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "args": vars(args),
                    "shape": shape,
                    **pair_comparison(args.pair.split(","), shape, args, device),
                },
                indent=2,
            )
        )
        print(f"\nwrote {out}")
        return
    rungs = args.rungs.split(",") if args.rungs else (RUNGS if args.model == "ladder" else LARGE_VOCAB_RUNGS)
    rows = []
    for rung in rungs:
        print(f"running {rung} ...", flush=True)
        rows.append(run_rung(rung, shape, args, device))
    compile_cmp = compile_times(shape, args, device) if args.compile_layers and args.model == "ladder" else {}
    params = sum(
        p.numel() for p in reference_model(shape["layers"], shape["hidden"], vocab=shape["vocab"]).parameters()
    )
    print_table(rows, shape, args, params)
    print_targets(rows) if args.model == "ladder" else large_vocab_summary(rows)
    if compile_cmp:
        full, reg = compile_cmp["compile"], compile_cmp["compile:regional"]
        print(
            f"\ncompile time, {args.compile_layers}-layer model (first step minus a steady step): whole model "
            f"{full['compile_s']:.1f} s, regional {reg['compile_s']:.1f} s -> regional/whole = {reg['compile_s'] / full['compile_s']:.2f}"
        )
    default = "ladder.json" if args.model == "ladder" else "ladder_large_vocab.json"
    out = Path(args.out or results / default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": machine(),
                "native_bf16": cpu_has_native_bf16(),
                "args": vars(args),
                "shape": shape,
                "params": params,
                "rungs": rows,
                "compile": compile_cmp,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")
    if args.model == "ladder":
        _plot(rows, out.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart (pip install matplotlib)")
        return
    base = next((r for r in rows if r["rung"] == "fp32"), rows[0])
    names = [r["rung"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 6))
    a.barh(names, [base["step_s"] / r["step_s"] for r in rows], color="tab:blue")
    a.set_xlabel("speed vs eager fp32 (x)")
    a.invert_yaxis()
    b.barh(names, [r["peak_bytes"] / 2**20 for r in rows], color="tab:orange", label="peak")
    b.barh(names, [r["model_state_bytes"] / 2**20 for r in rows], color="tab:green", label="model states at the peak")
    b.barh(names, [r["activation_bytes"] / 2**20 for r in rows], color="tab:red", label="activations after forward")
    b.set_xlabel("MiB")
    b.invert_yaxis()
    b.set_yticklabels([])
    b.legend()
    fig.suptitle(f"hf_memstack ladder - {machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
