"""mlp:tiled on a Llama-style block at long sequences: the peak of the block's forward + backward
(checkpointed, as the block's recompute runs it) and of its MLP alone, tiled against untiled, the
step-time ratio from interleaved runs, and the estimator against the meter on a 2-layer model.

    python bench/tiled_mlp.py                                # hidden 1024, intermediate 3584 (Llama-3's 3.5x), 4k and 16k tokens
    python bench/tiled_mlp.py --tokens 4096 --runs 5

The block is Transformers' LlamaDecoderLayer, the tiling hf_memstack's TiledMLPForward (tiles of
``--tile`` tokens, default: the hidden size), precision as ``auto`` picks on this machine (or ``--precision``).
The block is also measured with its MLP as the identity: the floor no tiling of the MLP goes below. Peaks from
PyTorch's MemTracker (live tensor bytes, weights and their gradients excluded). Results:
``bench/results/tiled_mlp.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, measured_against_estimate, timed  # noqa: E402

from hf_memstack import MemoryPolicy  # noqa: E402
from hf_memstack.measure.tracker import _frozen_aware_tracker  # noqa: E402
from hf_memstack.transforms.precision.apply import cpu_has_native_bf16, resolve_precision  # noqa: E402
from hf_memstack.transforms.tiled_mlp import TiledMLPForward, auto_tile_tokens  # noqa: E402


def config(args: argparse.Namespace, tokens: int, layers: int = 1) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=args.vocab,
        max_position_embeddings=max(tokens, 4096),
        attn_implementation="sdpa",
    )


class Block:
    """One decoder layer, its rotary embeddings and input, run checkpointed under the precision's autocast."""

    def __init__(self, args: argparse.Namespace, tokens: int, dtype: torch.dtype) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        cfg = config(args, tokens)
        torch.manual_seed(0)
        self.layer = LlamaDecoderLayer(cfg, 0).train()
        self.x0 = torch.randn(1, tokens, args.hidden)
        self.positions = torch.arange(tokens).unsqueeze(0)
        self.embeddings = LlamaRotaryEmbedding(cfg)(self.x0, self.positions)
        self.dtype = dtype
        self.untiled = self.layer.mlp.forward
        self.tiled = TiledMLPForward(self.layer.mlp, tile_tokens=args.tile or auto_tile_tokens(args.hidden))

    def use(self, tiled: bool) -> None:
        self.layer.mlp.forward = self.tiled if tiled else self.untiled

    def step(self, *, mlp_only: bool = False) -> None:
        x = self.x0.clone().requires_grad_(True)
        for p in self.layer.parameters():
            p.grad = None
        autocast = torch.autocast("cpu", self.dtype, enabled=self.dtype != torch.float32)

        def run(h: torch.Tensor) -> torch.Tensor:
            with autocast:
                if mlp_only:
                    return self.layer.mlp(h)
                return self.layer(
                    h, position_embeddings=self.embeddings, attention_mask=None, position_ids=self.positions
                )

        out = checkpoint(run, x, use_reentrant=False)
        out.float().sum().backward()

    def peak(self, *, mlp_only: bool = False) -> int:
        tracker = _frozen_aware_tracker()
        tracker.track_external(self.layer)
        with tracker:
            self.step(mlp_only=mlp_only)
        snap = tracker.get_tracker_snapshot("peak")
        total = sum(int(v) for dev in snap.values() for k, v in dev.items() if "Total" in str(k))
        states = 2 * sum(p.numel() * p.element_size() for p in self.layer.parameters())  # weights + gradients
        return total - states


def block_figures(args: argparse.Namespace, tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    block = Block(args, tokens, dtype)
    out: dict[str, Any] = {"tokens": tokens, "tile_tokens": block.tiled.tile_tokens}
    for tiled in (False, True):
        block.use(tiled)
        key = "tiled" if tiled else "untiled"
        out[f"block_peak_{key}"] = block.peak()
        out[f"mlp_peak_{key}"] = block.peak(mlp_only=True)
    # The floor no MLP tiling goes below: the block with its MLP as the identity (attention, norms, residuals).
    block.layer.mlp.forward = lambda h: h * 1.0
    out["block_peak_without_mlp"] = block.peak()
    times: dict[str, list[float]] = {"untiled": [], "tiled": []}
    for i in range(args.runs):
        for tiled in (False, True) if i % 2 == 0 else (True, False):  # each side first half the time
            block.use(tiled)
            times["tiled" if tiled else "untiled"].append(timed(block.step, "cpu"))
    out["times"] = times
    out["block_peak_ratio"] = out["block_peak_tiled"] / out["block_peak_untiled"]
    out["mlp_peak_ratio"] = out["mlp_peak_tiled"] / out["mlp_peak_untiled"]
    out["block_without_mlp_ratio"] = out["block_peak_without_mlp"] / out["block_peak_untiled"]
    ratios = [t / u for t, u in zip(times["tiled"], times["untiled"])]
    out["time_ratio_median"] = statistics.median(ratios)
    out["time_ratios"] = ratios
    return out


def estimator_figures(args: argparse.Namespace, precision: str) -> list[dict[str, Any]]:
    """The estimate against the meter's measured step (AdamW) on a 2-layer model, untiled and tiled."""
    tokens = args.estimate_tokens
    cfg = config(args, tokens, layers=2)
    batch = {"input_ids": torch.randint(3, args.vocab, (1, tokens), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]
    rows = []
    for spec in (f"{precision}+ckpt+loss:chunked", f"{precision}+ckpt+loss:chunked+mlp:tiled"):
        policy = MemoryPolicy.from_string(spec)
        rows.append({"policy": spec, "tokens": tokens, **measured_against_estimate(cfg, policy, batch)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3584)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tile", type=int, default=None)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--estimate-tokens", type=int, default=4096)
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "tiled_mlp.json"))
    args = ap.parse_args()
    precision = resolve_precision(args.precision, "cpu")
    native = cpu_has_native_bf16()
    print(
        f"machine: {machine()}; native bf16: {'yes' if native else 'no'}; precision {precision.name} ({args.precision})"
    )
    blocks = [block_figures(args, n, precision.dtype) for n in args.tokens]
    print(
        f"\nLlama-style block, hidden {args.hidden}, intermediate {args.intermediate}, checkpointed, {precision.name}; "
        f"{args.runs} interleaved runs per side\n"
    )
    print(
        "| tokens | tile | block fwd+bwd peak MiB untiled -> tiled | ratio | MLP fwd+bwd peak MiB untiled -> tiled | ratio | "
        "block without its MLP | step s untiled / tiled (median) | time ratio (median of pairs) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for b in blocks:
        mib = 2**20
        print(
            f"| {b['tokens']} | {b['tile_tokens']} | {b['block_peak_untiled'] / mib:.0f} -> {b['block_peak_tiled'] / mib:.0f} | "
            f"{b['block_peak_ratio']:.2f}x | {b['mlp_peak_untiled'] / mib:.0f} -> {b['mlp_peak_tiled'] / mib:.0f} | "
            f"{b['mlp_peak_ratio']:.2f}x | {b['block_peak_without_mlp'] / mib:.0f} ({b['block_without_mlp_ratio']:.2f}x) | {statistics.median(b['times']['untiled']):.2f} / {statistics.median(b['times']['tiled']):.2f} | "
            f"{b['time_ratio_median']:.3f} |"
        )
    estimates = estimator_figures(args, precision.name) if args.estimate_tokens else []
    for e in estimates:
        print(
            f"\nestimator, 2 layers, {e['tokens']} tokens, {e['policy']}: measured {e['measured'] / 2**20:.0f} MiB, "
            f"estimated {e['estimated'] / 2**20:.0f} MiB ({e['error']:+.1%})"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "machine": machine(),
                "native_bf16": native,
                "precision": precision.name,
                "args": vars(args),
                "blocks": blocks,
                "estimates": estimates,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
