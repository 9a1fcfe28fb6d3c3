"""The loss head alone, side by side with the peers: hidden states in, loss and gradients (of the
hidden states and the head's weight) out, forward + backward, interleaved runs in one process.

    python bench/loss_head.py                        # 2,048 tokens, hidden 1024, vocabularies 32k and 128k
    python bench/loss_head.py --vocab 32000 --runs 9 --dtype fp32
    python bench/loss_head.py --masked 0 0.5 0.8     # the default: 0%, 50%, 80% of the targets -100 (prompt masking)

Implementations (each where it installs; the table says which ran):
* Transformers' way: the head's logits, then the cross-entropy on their fp32 copy;
* PyTorch's ``F.linear_cross_entropy`` (chunked, in PyTorch 2.13);
* torchtune's ``CEWithChunkedOutputLoss`` over 8 chunks of the head's output, its
  ``compute_cross_entropy`` compiled as torchtune's recipes do;
* TRL's ``ChunkedLogProbFunction`` (its torch path, the one that runs on a CPU; with masked targets
  over the labelled rows only, gathered first as its GPU kernel's caller does: it has no ignore index);
* cut-cross-entropy's ``torch_compile`` implementation (its 5 lines: the logits and the fp32
  cross-entropy under one ``torch.compile``); the package imports Triton at import time, so on a
  machine without Triton its function is copied here, not imported;
* hf_memstack's fused chunks, eager and with the per-chunk work compiled (``compiled=True``): over
  the labelled targets only (the masked ones never reach the head).

Masked cases (``--masked``): the first fraction of the tokens has target -100, as a prompt has;
every implementation computes the mean over the rest.

Peaks: the process's resident high-water mark over one forward + backward (what compiled kernels
allocate too; glibc returns freed buffers at once with MALLOC_MMAP_THRESHOLD_, which the script
sets), and for eager implementations PyTorch's MemTracker (live tensor bytes) as a cross-check.
Times: the median of interleaved runs after a warm-up (which includes the compiles). Results: ``bench/results/loss_head.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, timed  # noqa: E402

from hf_memstack.measure.tracker import _frozen_aware_tracker  # noqa: E402  (the meter's tracker, for a bare function)
from hf_memstack.transforms.loss_head.chunked import auto_chunk_tokens, chunked_lm_loss  # noqa: E402
from hf_memstack.transforms.precision.apply import cpu_has_native_bf16  # noqa: E402


def implementations(head: torch.nn.Linear, target: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """name -> fn(hidden) -> loss (mean over the tokens), each under the same autocast."""
    v, n = head.out_features, target.shape[0]
    chunk = auto_chunk_tokens(v)
    cast = contextlib.nullcontext if dtype == torch.float32 else lambda: torch.autocast("cpu", dtype)
    fns: dict[str, Any] = {}

    def transformers_way(x):
        with cast():
            logits = head(x)
        return F.cross_entropy(logits.float(), target)

    fns["Transformers (logits + fp32 CE)"] = transformers_way

    if hasattr(F, "linear_cross_entropy"):

        def torch_lce(x):
            w, xb = head.weight.to(dtype), x.to(dtype)
            return F.linear_cross_entropy(xb, w, target, options=torch.nn.LinearCrossEntropyOptions()).float()

        fns["PyTorch F.linear_cross_entropy"] = torch_lce

    torchtune_loss = _torchtune_chunked_ce()
    if torchtune_loss is not None:
        torchtune_loss.compute_cross_entropy = torch.compile(torchtune_loss.compute_cross_entropy)

        def torchtune_chunked(x):
            with cast():
                chunks = [head(c) for c in x.unsqueeze(0).chunk(8, dim=1)]
            return torchtune_loss(chunks, target.unsqueeze(0))

        fns["torchtune CEWithChunkedOutputLoss (compiled CE)"] = torchtune_chunked

    trl_fn = _trl_chunked_logprob()
    if trl_fn is not None:
        keep = (target != -100).nonzero().squeeze(1)
        rows = None if keep.numel() == n else keep  # no ignore index: masked targets are left out first

        def trl_chunked(x):
            xs, ts = (x, target) if rows is None else (x.index_select(0, rows), target.index_select(0, rows))
            with cast():
                logprobs = trl_fn.apply(xs, head.weight, None, ts, 1.0, 4096, None, 1.0, ())[0]
            return -logprobs.float().mean()

        fns["TRL ChunkedLogProbFunction (torch path)"] = trl_chunked

    cce_compiled = torch.compile(_cce_torch_compile_apply, fullgraph=True, dynamic=True)

    def cce(x):
        with cast():
            return cce_compiled(x.to(dtype), head.weight.to(dtype), target)

    fns["cut-cross-entropy torch_compile"] = cce

    def ours(x, compiled=False):
        with cast():
            return chunked_lm_loss(
                x.unsqueeze(0), head, shift_labels=target.unsqueeze(0), chunk_tokens=chunk, compiled=compiled
            )

    fns["hf_memstack fused chunks"] = ours
    fns["hf_memstack fused chunks, compiled"] = lambda x: ours(x, compiled=True)
    assert n > 0
    return fns


def _cce_torch_compile_apply(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # cut_cross_entropy/torch_compile.py, torch_compile_linear_cross_entropy_apply (no softcap, reduction="mean").
    logits = e @ c.T
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="mean")


def _torchtune_chunked_ce() -> Any:
    """torchtune's CEWithChunkedOutputLoss, loaded from its file (its package __init__ needs torchao's NF4)."""
    spec = importlib.util.find_spec("torchtune")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "modules" / "loss" / "ce_chunked_output_loss.py"
    module_spec = importlib.util.spec_from_file_location("torchtune_ce_chunked_output_loss", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.CEWithChunkedOutputLoss(num_output_chunks=8)


def _trl_chunked_logprob() -> Any:
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction


class _Call(torch.nn.Module):
    def __init__(self, fn: Any, head: torch.nn.Module) -> None:
        super().__init__()
        self.fn, self.head = fn, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def measure(vocab: int, masked: float, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, vocab, bias=False)
    head.weight.data.mul_(0.02)
    hidden0 = torch.randn(args.tokens, args.hidden)
    target = torch.randint(0, vocab, (args.tokens,))
    target[: int(args.tokens * masked)] = -100  # the prompt: no loss on it
    fns = {
        name: fn
        for name, fn in implementations(head, target, dtype).items()
        if not args.only or name.startswith("Transformers") or any(o in name for o in args.only)
    }
    out: dict[str, Any] = {}
    for name, fn in fns.items():
        x = hidden0.clone().requires_grad_(True)
        head.weight.grad = None
        fn(x).backward()  # warm-up: compiles, caches
        out[name] = {"peak_bytes": _rss_peak(fn, hidden0, head), "tracked_peak_bytes": None, "times": []}
        if "compile" not in name:  # MemTracker's dispatch mode runs no compiled code: eager implementations only
            out[name]["tracked_peak_bytes"] = _tracked_peak(fn, hidden0, head)
        x = hidden0.clone().requires_grad_(True)
        head.weight.grad = None
        loss = fn(x)
        loss.backward()
        out[name].update(loss=float(loss.detach()), grad_w=head.weight.grad.float().norm().item())
    for _ in range(args.runs):
        for name, fn in fns.items():
            x = hidden0.clone().requires_grad_(True)
            head.weight.grad = None
            out[name]["times"].append(timed(lambda fn=fn, x=x: fn(x).backward(), "cpu"))
    return {"vocab": vocab, "masked": masked, "chunk_tokens": auto_chunk_tokens(vocab), "results": out}


def _tracked_peak(fn: Any, hidden0: torch.Tensor, head: torch.nn.Linear) -> int:
    x = hidden0.clone().requires_grad_(True)
    head.weight.grad = None
    tracker = _frozen_aware_tracker()
    call = _Call(fn, head)
    tracker.track_external(call)
    with tracker:
        call(x).backward()
    return sum(
        int(v) for dev in tracker.get_tracker_snapshot("peak").values() for k, v in dev.items() if "Total" in str(k)
    )


def _rss_peak(fn: Any, hidden0: torch.Tensor, head: torch.nn.Linear) -> int:
    """The process's resident high-water mark over one forward + backward, above what was resident
    before it (the kernel's VmHWM, reset first): what compiled code allocates too. The weight and
    the input are resident before; their gradients count. Needs MALLOC_MMAP_THRESHOLD_ (set by main)
    so that freed buffers leave the process at once."""
    import gc

    x = hidden0.clone().requires_grad_(True)
    head.weight.grad = None
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    fn(x).backward()
    return _status("VmHWM") - before


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def report(run: dict[str, Any], args: argparse.Namespace) -> None:
    res = run["results"]
    ref = res["Transformers (logits + fp32 CE)"]
    t_ref = statistics.median(ref["times"])
    print(
        f"\nvocabulary {run['vocab']}, {run['masked']:.0%} of the targets masked: {args.tokens} tokens, hidden {args.hidden}, {args.dtype}, chunks of {run['chunk_tokens']} "
        f"tokens (ours); {args.runs} interleaved runs; peaks: the resident growth over one forward + backward (the weight's gradient included)\n"
    )
    print(
        "| implementation | fwd+bwd s, median [min-max] | time vs Transformers | peak MiB (resident) | peak vs Transformers | "
        "MemTracker peak MiB | loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        t = statistics.median(r["times"])
        tracked = f"{r['tracked_peak_bytes'] / 2**20:.0f}" if r["tracked_peak_bytes"] else "n/a (compiled)"
        print(
            f"| {name} | {t:.3f} [{min(r['times']):.3f}-{max(r['times']):.3f}] | {t / t_ref:.2f}x | {r['peak_bytes'] / 2**20:.0f} | "
            f"{r['peak_bytes'] / ref['peak_bytes']:.2f}x | {tracked} | {r['loss']:.4f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    ap.add_argument("--masked", type=float, nargs="+", default=[0.0, 0.5, 0.8], help="fractions of targets -100")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument(
        "--only", nargs="+", help="run only the implementations whose names contain one of these (and Transformers')"
    )
    ap.add_argument("--dtype", choices=["bf16", "fp32", "auto"], default="auto")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "loss_head.json"))
    args = ap.parse_args()
    if (
        os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536"
    ):  # freed tensors go back to the kernel: resident peaks are real
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    native = cpu_has_native_bf16()
    if args.dtype == "auto":
        args.dtype = "bf16" if native else "fp32"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"machine: {machine()}; native bf16: {'yes' if native else 'no (bf16 emulated)'}")
    runs = [measure(v, m, args, dtype) for v in args.vocab for m in args.masked]
    for run in runs:
        report(run, args)
    Path(args.out).write_text(
        json.dumps({"machine": machine(), "native_bf16": native, "args": vars(args), "runs": runs}, indent=1)
    )


if __name__ == "__main__":
    main()
