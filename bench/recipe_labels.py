"""End to end on instruction data: the recipe's training tokens/s on prompt/response rows (the prompt
labelled -100, the loss on the response), Transformers' own loss against ``loss:chunked`` - which
gathers the labelled positions and runs the output head over those only - as interleaved recipe runs
in one invocation, with the ratios.

    python bench/recipe_labels.py               # 1 min 42 s on 2 quiet cores (an AMX Xeon)
    python bench/recipe_labels.py --prompt-share 0.5 --rounds 5
    python bench/recipe_labels.py --rounds 1 --steps 1 --out /tmp/smoke.json   # a smoke test (no timing)

The default job: a Llama of hidden 512, 4 layers, vocabulary 32k (random weights, saved to a temporary
folder with a word-level tokenizer of 32k words: nothing is downloaded), samples of 768-1,024 tokens
(one a row, padded to the batch's longest) whose first 75% are the prompt, batch 2, the
recipe's own flags (``--prompt-field``/``--response-field``: the recipe's prompt/response mode
masks the prompt; no chat template on this tokenizer, so the prompt is its text and a newline).
Unpacked, one sample a row, so the labelled share is the prompt split's.
Each round runs the recipe once with ``PRECISION`` and once with ``PRECISION+loss:chunked`` (the
order alternating between rounds), each for ``--steps`` optimizer steps logged every step; a run's
tokens/s is the median of its steps after the first (which holds the warm-up and, on a CPU, the
memory meter's step). PRECISION is bf16 where the CPU computes it natively (avx512_bf16 / AMX), else
fp32 (``--precision`` to force one); the machine line says which.

Time: ``--rounds 3 --steps 5`` (the default) is 6 recipe runs. A 1-step smoke run of the default job on
2 shared, loaded cores (an AMD EPYC with native bf16) took 31-33 s a run: ~20 s of start-up (imports,
tokenizing, the end's evaluation and save) and a first step of ~1,800 tokens at 164-181 tokens/s (the
memory meter's step). At that pace the default is about 6 minutes; on 2 quiet cores about 4-5. In
emulated bf16 (``--precision bf16`` on a CPU without it) several times that.

Printed: per round the two runs' tokens/s and their ratio, then the median ratio (``chunked / plain``:
above 1 means loss:chunked trains more tokens a second) beside the planner's factor for this model and
labelled share (``hf-memstack plan --label-fraction``), the labelled share of the positions, and the
first logged loss of each (the same rows and seed: they agree to bf16 noise). Results:
``bench/results/recipe_labels.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import FINETUNE, ROOT, machine, reference_config

RESULTS = ROOT / "bench" / "results" / "recipe_labels.json"


def build_model(folder: Path, hidden: int, layers: int, vocab: int, seq: int) -> None:
    """A Llama of this shape (random weights, seed 0) and a word-level tokenizer of ``vocab`` words."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "[EOS]", *(f"w{i}" for i in range(3, vocab))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    config = reference_config(
        layers, hidden, vocab, max_position_embeddings=seq, pad_token_id=1, eos_token_id=2, bos_token_id=2
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)


def write_rows(path: Path, count: int, seq: int, vocab: int, prompt_share: float, seed: int) -> float:
    """``count`` prompt/response rows of random words (one token each), 3/4 of ``seq`` to ``seq`` tokens a
    sample; returns the share of the positions that carry a label (the response's words and its EOS)."""
    rng = random.Random(seed)
    labelled = positions = 0
    with path.open("w") as f:
        for _ in range(count):
            n = rng.randint(seq * 3 // 4, seq) - 1  # the EOS the recipe appends is the last token
            prompt = max(1, round(n * prompt_share))
            sample = [f"w{rng.randrange(3, vocab)}" for _ in range(n)]
            f.write(json.dumps({"prompt": " ".join(sample[:prompt]), "response": " ".join(sample[prompt:])}) + "\n")
            labelled += n - prompt + 1
            positions += n + 1
    return labelled / positions


def run_recipe(policy: str, folder: Path, data: Path, val: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One recipe run in a subprocess: its per-step tokens/s and losses from report.json."""
    cmd = [
        sys.executable,
        str(FINETUNE),
        *("--model", str(folder), "--dataset", str(data), "--validation-file", str(val)),
        *("--prompt-field", "prompt", "--response-field", "response"),
        *("--seq-len", str(args.seq), "--batch-size", str(args.batch), "--policy", policy),
        *("--max-steps", str(args.steps), "--log-every", "1", "--eval-every", "0", "--seed", "0"),
        *("--lr", "1e-4", "--output-dir", str(out)),
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{policy} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    history = json.loads((out / "report.json").read_text())["history"]
    timed = history[1:] or history  # the first step: warm-up and the memory meter
    return {
        "policy": policy,
        "seconds": time.perf_counter() - start,
        "tokens_per_s": statistics.median(h["tokens_per_s"] for h in timed),
        "steps": [h["tokens_per_s"] for h in history],
        "first_loss": history[0]["loss"],
    }


def planned_factor(folder: Path, seq: int, label_share: float) -> float:
    """The planner's speed factor of loss:chunked over the model's own loss for this model and share
    (hf_memstack.planning.plan.head_speed), to set beside the measured ratio."""
    import torch
    from transformers import AutoConfig

    from hf_memstack.planning.plan.head_speed import chunked_loss_speed, head_share

    config = AutoConfig.from_pretrained(folder)
    return chunked_loss_speed(head_share(config, task="causal-lm", dtype=torch.float32, seq_len=seq), label_share)


def main() -> None:
    from hf_memstack.transforms.precision.apply import cpu_has_native_bf16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024, help="longest sample, in tokens")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt-share", type=float, default=0.75, help="each sample's share of prompt tokens")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps a run (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved pairs of runs")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument(
        "--out", type=Path, default=RESULTS, help=f"the results' JSON (default {RESULTS.relative_to(ROOT)})"
    )
    args = ap.parse_args()
    native = cpu_has_native_bf16()
    precision = args.precision if args.precision != "auto" else ("bf16" if native else "fp32")
    print(f"machine: {machine()}; native bf16: {'yes' if native else 'no (bf16 emulated)'}; runs in {precision}")
    policies = [precision, f"{precision}+loss:chunked"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_model(root / "model", args.hidden, args.layers, args.vocab, args.seq)
        # Enough samples for every step (one a row), and 4 to evaluate.
        count = args.steps * args.batch + 8
        share = write_rows(root / "train.jsonl", count, args.seq, args.vocab, args.prompt_share, seed=0)
        write_rows(root / "val.jsonl", 4, args.seq, args.vocab, args.prompt_share, seed=1)
        print(f"labelled share of the positions: {share:.2f} (prompt share {args.prompt_share:.2f} of each sample)")
        planned = planned_factor(root / "model", args.seq, share)
        rounds = []
        for r in range(args.rounds):
            pair = {}
            for policy in policies if r % 2 == 0 else policies[::-1]:
                out = root / f"run{r}_{policy.replace('+', '_').replace(':', '-')}"
                pair[policy] = run_recipe(policy, root / "model", root / "train.jsonl", root / "val.jsonl", args, out)
            ratio = pair[policies[1]]["tokens_per_s"] / pair[policies[0]]["tokens_per_s"]
            rounds.append({"runs": pair, "ratio": ratio})
            plain, chunked = (pair[p] for p in policies)
            print(
                f"round {r + 1}: {policies[0]} {plain['tokens_per_s']:.0f} tokens/s, {policies[1]} "
                f"{chunked['tokens_per_s']:.0f} tokens/s: {ratio:.2f}x (first losses {plain['first_loss']:.4f} / "
                f"{chunked['first_loss']:.4f}; {plain['seconds']:.0f} s / {chunked['seconds']:.0f} s a run)"
            )
    ratios = [r["ratio"] for r in rounds]
    print(
        f"loss:chunked / Transformers' loss, recipe tokens/s at {share:.0%} labelled: median {statistics.median(ratios):.2f}x "
        f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}); the planner's factor for this job: {planned:.2f}x"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine(),
                "native_bf16": native,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "labelled_share": share,
                "planned_factor": planned,
                "rounds": rounds,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
