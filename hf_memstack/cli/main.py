"""The ``hf-memstack`` command's entry point: parse (``parser.py``, whose docstring is the --help
text), run ``estimate``, ``plan`` or ``find-batch-size``, and map the outcome to the exit status."""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from .._quiet import quiet_imports
from .._text import printable
from ..errors import BudgetTooSmallError
from ..models import resolve_model_alias
from .estimate import Refused, estimate_each, refusal_lines, verdict
from .output import plot_breakdown, print_estimates, require_matplotlib
from .parser import build_parser, negative_sizes_joined

# The estimator, planner, finder and prepare_model (torch, transformers) are imported inside the
# functions that use them, each marked "--help stays fast": parsing the command line needs none of them.

FITS, DOES_NOT_FIT, USAGE, INTERNAL = 0, 1, 2, 3


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(negative_sizes_joined(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)
    try:
        if getattr(args, "plot", None):
            require_matplotlib()  # before the estimate: not a table first and the failure after it
        args.model = resolve_model_alias(args.model)
        with quiet_imports():  # the first Transformers import loads torchao, bitsandbytes: only their noise is dropped
            return {"estimate": _estimate, "plan": _plan, "find-batch-size": _find}[args.command](args)
    except BudgetTooSmallError as e:
        print(f"hf-memstack {args.command}: does not fit: {printable(str(e))}", file=sys.stderr)
        return DOES_NOT_FIT
    except (ValueError, TypeError, OSError, ImportError) as e:
        print(f"hf-memstack {args.command}: error: {printable(str(e))}", file=sys.stderr)  # may quote a received file
        return USAGE
    except Exception:  # noqa: BLE001 - not "does not fit", not bad input: a bug, said as such
        traceback.print_exc()
        print(
            f"hf-memstack {args.command}: internal error (exit {INTERNAL}); please report it with the traceback above",
            file=sys.stderr,
        )
        return INTERNAL


def _trainable(args: argparse.Namespace) -> dict[str, object] | str:
    lora = {
        k: v
        for k, v in (
            ("r", args.lora_r),
            ("lora_alpha", args.lora_alpha),
            ("target_modules", args.lora_target.split(",") if args.lora_target else None),
        )
        if v is not None
    }
    if args.trainable == "all" and lora:
        raise ValueError(f"--trainable all contradicts --lora-* options ({sorted(lora)}); drop one of them")
    if lora:
        return lora
    return args.trainable or "all"


def _estimate(args: argparse.Namespace) -> int:
    from ..planning.estimate.estimator import estimate_memory

    job = {
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "world_size": args.world_size,
        "task": args.task,
        "trainable": _trainable(args),
        "dtype": args.dtype,
        "extrapolate": not args.full_trace,
        "mode": args.mode,
        "eval_samples": args.eval_samples,
        "device": args.device,
        "label_fraction": args.label_fraction,
        "keep_outputs": args.keep_outputs,
        "packed": args.packed,
        **_images(args),
    }
    rows = estimate_each([p.strip() for p in args.policy.split(",")], lambda p: estimate_memory(args.model, p, **job))
    if all(isinstance(r, Refused) for r in rows):  # nothing answered: an input error
        print("\n".join(f"hf-memstack {args.command}: error: {line}" for line in refusal_lines(rows)), file=sys.stderr)
        return USAGE
    verdicts = [verdict(e, args.budget) for e in rows]
    print_estimates(rows, verdicts, budget=args.budget, mode=args.mode, as_json=args.json)
    if args.plot:
        plot_breakdown([(e.policy, e) for e in rows if not isinstance(e, Refused)], args.plot, args.budget)
    # Several policies are alternatives: the run can use any that fits (a refused one, like one that
    # does not fit, takes nothing from the others).
    return FITS if any(verdicts) else DOES_NOT_FIT


def _plan(args: argparse.Namespace) -> int:
    # here, not at the top: --help stays fast
    from ..planning.estimate.estimator import estimate_memory
    from ..planning.plan.planner import plan_policy

    # What every rung shares, in the plan and in the plot's estimates.
    job = {
        "seq_len": args.seq_len,
        "world_size": args.world_size,
        "task": args.task,
        "trainable": _trainable(args),
        "dtype": args.dtype,
        "device": args.device,
        "keep_outputs": args.keep_outputs,
        "packed": args.packed,
        **_images(args),
        "label_fraction": args.label_fraction,
    }
    plan = plan_policy(args.model, budget=args.budget, batch_size=args.batch_size, margin=args.margin, **job)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else printable(plan.table()))
    _print_task_note(args)
    if args.plot:
        b = plan.batch_size or 1
        estimates = [(r.policy, estimate_memory(args.model, r.policy, batch_size=b, **job)) for r in plan.rows]
        plot_breakdown(estimates, args.plot, plan.budget)
    return FITS if plan.fits else DOES_NOT_FIT


def _images(args: argparse.Namespace) -> dict[str, int | None]:
    return {"image_size": args.image_size, "images_per_sample": args.images_per_sample}


def _find(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: --help stays fast

    # Imported here: keeps hf-memstack --help fast (the finder, the estimator and prepare_model need torch).
    from ..batch_size import find_batch_size
    from ..planning.estimate.trainable import peft_config_from
    from ..planning.model.config import build_model, check_seq_len, infer_task, load_config
    from ..planning.model.synthetic_batch import synthetic_batches
    from ..prepare import prepare_model

    config = load_config(args.model)
    check_seq_len(config, args.seq_len)
    peft_config = peft_config_from(_trainable(args))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    task = args.task or infer_task(args.model, config)
    _print_task_note(args)
    make_batch = synthetic_batches(config, task, args.seq_len, device, **_images(args))  # checked before building
    model = prepare_model(build_model(config, task, peft_config).to(device).train(), args.policy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    result = find_batch_size(
        model,
        make_batch,
        optimizer,
        budget=args.budget,
        global_batch_size=args.global_batch_size,
        cache=not args.no_cache,
    )
    print(json.dumps(result.as_dict(), indent=2, default=str) if args.json else printable(result.summary()))
    return FITS


def _print_task_note(args: argparse.Namespace) -> None:
    """Say which head an encoder got when --task was left out (estimate prints it among its notes)."""
    from ..planning.model.config import load_config, task_note

    note = task_note(args.model, load_config(args.model)) if args.task is None and not args.json else None
    if note:
        print(f"note: {printable(note)}")


if __name__ == "__main__":
    sys.exit(main())
