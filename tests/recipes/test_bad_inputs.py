"""A table of bad inputs tried against the real recipe: config values (flags and files), data
files, checkpoints and output directories. Each must end with a RecipeError (exit status 2) whose
message names the field or file and the value, and says what to do - and leave every directory
involved exactly as it was (nothing written, nothing lost). The test prints the tally:
"N bad inputs, M clear errors, nothing written"."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from recipe_utils import lm_args, load_recipe, reset_accelerate, snapshot
from test_bad_data import CASES as DATA_CASES

pytestmark = pytest.mark.slow


@dataclass
class Ctx:
    """What a case builds from: a fresh folder, the tiny model, and a stopped run with checkpoints."""

    dir: Path
    tiny_lm: dict
    base: Path

    @property
    def out(self) -> Path:
        return self.dir / "out"

    def args(self, *extra, out: Path | None = None) -> list[str]:
        return [str(a) for a in lm_args(self.tiny_lm, out or self.out, "--max-steps", "8", "--save-every", "2", *extra)]

    def with_data(self, path: Path, *extra) -> list[str]:
        args = self.args(*extra)
        args[args.index("--dataset") + 1] = str(path)
        return args

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.dir / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def config(self, content: str, name: str = "c.yaml") -> list[str]:
        return ["--config", str(self.file(name, content)), "--output-dir", str(self.out)]

    def run_copy(self) -> Path:
        """A copy of the stopped run (checkpoints at steps 2 and 4) as this case's output directory."""
        shutil.copytree(self.base, self.out, symlinks=True)
        return self.out


@dataclass
class Case:
    area: str  # config | data | checkpoint | output
    name: str
    build: Callable[[Ctx], list[str]]  # the command line (and whatever files it needs)
    expect: tuple[str, ...]  # message fragments: the field/file and value, and the fix


def _ckpt(ctx: Ctx, step: int = 4) -> Path:
    return ctx.out / "checkpoints" / f"step-{step:07d}"


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _rewrite_manifest(ckpt: Path) -> None:
    """Make the checkpoint manifest agree with the files as they are now (a damage the sizes cannot see)."""
    manifest = ckpt / "checkpoint.json"
    m = json.loads(manifest.read_text())
    m["files"] = {name: (ckpt / name).stat().st_size for name in m["files"]}
    manifest.write_text(json.dumps(m))


def _zero_bytes(path: Path) -> None:
    path.write_bytes(b"\0" * path.stat().st_size)


def _trainer_state(ckpt: Path, **changes) -> None:
    state_file = ckpt / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), **changes}))
    _rewrite_manifest(ckpt)


def _user_dir(ctx: Ctx) -> Path:
    ctx.out.mkdir()
    (ctx.out / "thesis.tex").write_text("years of work")
    return ctx.out


CONFIG = [
    Case(
        "config",
        "lr nan (flag)",
        lambda c: c.args("--lr", "nan"),
        ("lr=nan is not a finite number", "give a real value"),
    ),
    Case(
        "config",
        "lr .nan (YAML)",
        lambda c: c.config("lr: .nan\n"),
        ("lr=nan is not a finite number", "give a real value"),
    ),
    Case("config", "epochs .inf (YAML)", lambda c: c.config("epochs: .inf\n"), ("epochs=inf is not a finite number",)),
    Case(
        "config",
        "grad_clip .nan (YAML)",
        lambda c: c.config("grad_clip: .nan\n"),
        ("grad_clip=nan is not a finite number",),
    ),
    Case(
        "config",
        "dist_timeout nan",
        lambda c: c.args("--dist-timeout", "nan"),
        ("dist_timeout=nan is not a finite number",),
    ),
    Case("config", "lr negative", lambda c: c.args("--lr", "-1"), ("lr=-1.0 must be positive", "e.g. 2e-4")),
    Case("config", "lr a list (YAML)", lambda c: c.config("lr: [1, 2]\n"), ("lr=[1, 2] (list) must be float",)),
    Case(
        "config", "seq_len null (YAML)", lambda c: c.config("seq_len: null\n"), ("seq_len=None (NoneType) must be int",)
    ),
    Case(
        "config", "max_steps 2.5 (YAML)", lambda c: c.config("max_steps: 2.5\n"), ("max_steps=2.5 (float) must be int",)
    ),
    Case(
        "config",
        "batch_size a list (YAML)",
        lambda c: c.config("batch_size: [8]\n"),
        ("batch_size=[8] (list) must be str",),
    ),
    Case(
        "config",
        "task not a task (YAML)",
        lambda c: c.config("task: translation\n"),
        ("task='translation' (str) must be 'auto', 'causal-lm', 'classification'",),
    ),
    Case(
        "config",
        "bool that is not (YAML)",
        lambda c: c.config("overwrite: maybe\n"),
        ("--overwrite", "Truthy value expected: got maybe"),
    ),
    Case(
        "config",
        "YAML file that is just 5",
        lambda c: c.config("5\n"),
        ("holds a int ('5'), not a mapping", "'field: value'"),
    ),
    Case("config", "broken YAML", lambda c: c.config("lr: [\n"), ("not valid YAML", "fix the file")),
    Case("config", "broken JSON", lambda c: c.config('{"lr": }', name="c.json"), ("not valid JSON", "fix the file")),
    Case(
        "config",
        "unknown field (YAML)",
        lambda c: c.config("learning_rate: 1.0\n"),
        ("unknown field(s) 'learning_rate'", "--help"),
    ),
    Case(
        "config",
        "missing --config file",
        lambda c: ["--config", str(c.dir / "nope.yaml")],
        ("nope.yaml': no such file",),
    ),
    Case(
        "config",
        "unknown flag",
        lambda c: [*c.args(), "--learning-rate", "1"],
        ("unknown argument(s) '--learning-rate'", "--help"),
    ),
    Case(
        "config",
        "int flag not an int",
        lambda c: c.args("--max-steps", "x"),
        ("--max-steps", "invalid int value: 'x'", "--help"),
    ),
    Case(
        "config",
        "task flag not a choice",
        lambda c: c.args("--task", "translation"),
        ("--task", "invalid choice: 'translation'"),
    ),
    Case(
        "config",
        "scheduler typo",
        lambda c: c.args("--lr-scheduler", "cosinee"),
        ("lr_scheduler='cosinee' is not a transformers scheduler (did you mean 'cosine'?)", "use one of linear"),
    ),
    Case(
        "config",
        "metric-driven scheduler",
        lambda c: c.args("--lr-scheduler", "reduce_lr_on_plateau"),
        ("lr_scheduler='reduce_lr_on_plateau' cannot be used here", "use one of"),
    ),
    Case(
        "config",
        "scheduler needing arguments",
        lambda c: c.args("--lr-scheduler", "cosine_with_min_lr"),
        ("lr_scheduler='cosine_with_min_lr' cannot be used here", "needs arguments"),
    ),
    Case(
        "config",
        "policy unknown token",
        lambda c: c.args("--policy", "bf16+turbo"),
        ("policy='bf16+turbo'", "unknown token 'turbo'", "allowed"),
    ),
    Case(
        "config",
        "policy file missing",
        lambda c: c.args("--policy", str(c.dir / "p.yaml")),
        ("p.yaml", "does not exist"),
    ),
    Case(
        "config",
        "policy file: compile backend nope",
        lambda c: c.args("--policy", str(c.file("p.yaml", "compile:\n  mode: full\n  backend: nope\n"))),
        ("compile.backend='nope' is not a torch.compile backend", "use one of inductor"),
    ),
    Case(
        "config",
        "policy file: a number",
        lambda c: c.args("--policy", str(c.file("p.yaml", "5\n"))),
        ("p.yaml", "not a mapping"),
    ),
    Case(
        "config",
        "policy file: bad precision",
        lambda c: c.args("--policy", str(c.file("p.yaml", "precision: bf17\n"))),
        ("policy.precision='bf17' is not one of", "pick one of those"),
    ),
    Case("config", "fp16 on CPU", lambda c: c.args("--policy", "fp16"), ("fp16 needs a GPU", "use bf16 or fp32")),
    Case(
        "config",
        "batch size 0",
        lambda c: c.args("--batch-size", "0"),
        ("batch_size='0' must be a positive integer or 'auto'",),
    ),
    Case(
        "config",
        "batch size text",
        lambda c: c.args("--batch-size", "lots"),
        ("batch_size='lots' must be a positive integer or 'auto'",),
    ),
    Case(
        "config",
        "auto batch without budget (CPU)",
        lambda c: c.args("--batch-size", "auto"),
        ("batch_size='auto' needs --memory-budget",),
    ),
    Case(
        "config",
        "budget not a size",
        lambda c: c.args("--batch-size", "auto", "--memory-budget", "10XB"),
        ("memory_budget='10XB' is not a size", "e.g. '20GiB'"),
    ),
    Case(
        "config",
        "budget negative, as a separate argument",
        lambda c: c.args("--batch-size", "auto", "--memory-budget", "-1GiB"),
        ("memory_budget='-1GiB' must be positive", "e.g. '20GiB'"),
    ),
    Case(
        "config",
        "budget with no effect",
        lambda c: c.args("--memory-budget", "8GiB"),
        ("memory_budget='8GiB' has no effect", "--batch-size auto"),
    ),
    Case(
        "config",
        "budget below the model (finder)",
        lambda c: c.args("--batch-size", "auto", "--memory-budget", "100KB"),
        ("batch_size=auto with memory_budget='100KB'",),
    ),
    Case(
        "config",
        "budget below the model (planner)",
        lambda c: c.args("--policy", "auto", "--memory-budget", "64KiB"),
        ("policy=auto: nothing fits memory_budget=64KiB", "raise --memory-budget"),
    ),
    Case("config", "seq_len 0", lambda c: c.args("--seq-len", "0"), ("seq_len=0 must be at least 1",)),
    Case(
        "config",
        "seq_len above the model's limit",
        lambda c: c.args("--seq-len", "64"),
        ("seq_len=64 is above", "use --seq-len 32 or less"),
    ),
    Case(
        "config", "warmup ratio 1.5", lambda c: c.args("--warmup-ratio", "1.5"), ("warmup_ratio=1.5 must be in [0, 1)",)
    ),
    Case(
        "config",
        "validation split 0",
        lambda c: c.args("--validation-split", "0"),
        ("validation_split=0.0 must be between 0 and 1",),
    ),
    Case("config", "keep_last 0", lambda c: c.args("--keep-last", "0"), ("keep_last=0 must be at least 1",)),
    Case(
        "config", "negative workers", lambda c: c.args("--num-workers", "-1"), ("num_workers=-1 must not be negative",)
    ),
    Case(
        "config",
        "negative weight decay",
        lambda c: c.args("--weight-decay", "-0.1"),
        ("weight_decay=-0.1 must be >= 0",),
    ),
    Case(
        "config",
        "negative grad clip",
        lambda c: c.args("--grad-clip", "-1"),
        ("grad_clip=-1.0 must be >= 0", "0 turns clipping off"),
    ),
    Case(
        "config",
        "global batch 0",
        lambda c: c.args("--global-batch-size", "0"),
        ("global_batch_size=0 must be a positive number",),
    ),
    Case("config", "seed -1", lambda c: c.args("--seed", "-1"), ("seed=-1 must be in [0, 2**32)",)),
    Case(
        "config",
        "stop-after without checkpoints",
        lambda c: [*c.args(), "--save-every", "0", "--stop-after", "2"],
        ("stop_after=2 needs --save-every",),
    ),
    Case(
        "config",
        "prompt without response",
        lambda c: c.args("--prompt-field", "prompt"),
        ("prompt_field and response_field go together",),
    ),
    Case(
        "config",
        "wrapped packing with prompts",
        lambda c: c.args("--packing", "wrapped", "--prompt-field", "prompt", "--response-field", "response"),
        ("packing='wrapped' cuts blocks across samples", "use --packing on"),
    ),
    Case(
        "config",
        "dataset missing",
        lambda c: c.with_data(c.dir / "nope.jsonl"),
        ("nope.jsonl' is not a file", ".jsonl"),
    ),
    Case(
        "config",
        "dataset of an unknown type",
        lambda c: c.with_data(c.file("d.xml", "<rows/>")),
        ("unsupported type '.xml'",),
    ),
    Case(
        "config",
        "hub dataset offline",
        lambda c: c.with_data("someone/no-such-dataset"),
        ("dataset='someone/no-such-dataset' could not be loaded", "check the id and the network"),
    ),
    Case(
        "config",
        "model directory missing",
        lambda c: [*c.args(), "--model", str(c.dir / "nomodel")],
        ("nomodel' is not a model directory (no config.json)", "save_pretrained"),
    ),
    Case(
        "config",
        "tokenizer directory missing",
        lambda c: [*c.args(), "--tokenizer", str(c.dir / "notok")],
        ("notok' is not a directory",),
    ),
    Case(
        "config",
        "tracker not installed",
        lambda c: c.args("--report-to", "tensorboard"),
        ("report_to='tensorboard'", "pip install tensorboard"),
    ),
    Case(
        "config",
        "tracker unknown",
        lambda c: c.args("--report-to", "nope"),
        ("report_to='nope' is not an Accelerate tracker",),
    ),
    Case(
        "config",
        "text field not in the data",
        lambda c: c.args("--text-field", "body"),
        ("line 1: field 'body' is missing",),
    ),
    Case(
        "config",
        "discard without resume",
        lambda c: c.args("--discard-later-checkpoints"),
        ("discard_later_checkpoints=True only applies with --resume-from",),
    ),
]

DATA = [
    Case(
        "data",
        name,
        (lambda c, filename=filename, content=content, extra=extra: c.with_data(c.file(filename, content), *extra)),
        tuple(fragments),
    )
    for name, (filename, content, extra, fragments) in DATA_CASES.items()
]


def _resume(
    ctx: Ctx, target: str | Callable[[Ctx], Path] = "latest", *extra: str, damage: Callable[[Ctx], object] | None = None
) -> list[str]:
    """Resume a copy of the stopped run (checkpoints at steps 2 and 4), after ``damage``."""
    out = ctx.run_copy()
    if damage is not None:
        damage(ctx)
    return ctx.args(*extra, "--resume-from", target if isinstance(target, str) else str(target(ctx)), out=out)


def _another_run_into_a_run(ctx: Ctx) -> list[str]:
    shutil.copytree(ctx.base, ctx.dir / "b", symlinks=True)
    return ctx.args("--resume-from", str(ctx.base / "checkpoints" / "step-0000002"), out=ctx.dir / "b")


def _other_data(ctx: Ctx) -> list[str]:
    ctx.run_copy()
    data = ctx.file("d.jsonl", "".join(json.dumps({"text": f"the cat ran {i}"}) + "\n" for i in range(20)))
    return ctx.with_data(data, "--resume-from", "latest")


def _tmp_copy(ctx: Ctx) -> Path:
    return _ckpt(ctx).with_name("step-0000006.tmp")


def _broken_manifest(ctx: Ctx) -> list[str]:
    args = ctx.args("--overwrite", out=ctx.run_copy())
    (ctx.out / "recipe_manifest.json").write_text("[")
    return args


CHECKPOINT = [
    Case(
        "checkpoint",
        "truncated weights in the latest",
        lambda c: _resume(c, damage=lambda c: _truncate(_ckpt(c) / "model.safetensors", 100)),
        (
            "step-0000004 is newer than the last complete checkpoint but incomplete",
            "model.safetensors has 100 bytes",
            "delete it to resume from step-0000002",
        ),
    ),
    Case(
        "checkpoint",
        "truncated trainer_state.json",
        lambda c: _resume(c, _ckpt, damage=lambda c: _truncate(_ckpt(c) / "trainer_state.json", 30)),
        ("not a complete checkpoint: trainer_state.json has 30 bytes", "pass a complete checkpoints/step-N folder"),
    ),
    Case(
        "checkpoint",
        "truncated trainer_state.json, manifest agreeing",
        lambda c: _resume(
            c, _ckpt, damage=lambda c: (_truncate(_ckpt(c) / "trainer_state.json", 30), _rewrite_manifest(_ckpt(c)))
        ),
        ("trainer_state.json is not readable JSON", "pass a complete checkpoints/step-N folder"),
    ),
    Case(
        "checkpoint",
        "trainer_state with a negative step",
        lambda c: _resume(c, _ckpt, damage=lambda c: _trainer_state(_ckpt(c), step=-1)),
        (
            "trainer_state.json is not a readable checkpoint state",
            "step=-1 is not a step count",
            "resume from an earlier checkpoint",
        ),
    ),
    Case(
        "checkpoint",
        "no manifest",
        lambda c: _resume(c, _ckpt, damage=lambda c: (_ckpt(c) / "checkpoint.json").unlink()),
        ("no checkpoint.json (the save did not finish)", "pass a complete checkpoints/step-N folder"),
    ),
    Case(
        "checkpoint",
        "unreadable manifest",
        lambda c: _resume(c, _ckpt, damage=lambda c: (_ckpt(c) / "checkpoint.json").write_text("{")),
        ("its checkpoint.json is unreadable", "pass a complete checkpoints/step-N folder"),
    ),
    Case(
        "checkpoint",
        "a .tmp folder",
        lambda c: _resume(c, _tmp_copy, damage=lambda c: shutil.copytree(_ckpt(c), _tmp_copy(c))),
        ("a .tmp folder is a save that never finished", "(or 'latest')"),
    ),
    Case(
        "checkpoint",
        "a folder that is no checkpoint",
        lambda c: c.args("--resume-from", str(c.file("x.txt", "x").parent)),
        ("not a complete checkpoint: its name is not step-N",),
    ),
    Case(
        "checkpoint",
        "a path that does not exist",
        lambda c: c.args("--resume-from", str(c.dir / "gone")),
        ("gone': no such directory", "or 'latest'"),
    ),
    Case(
        "checkpoint",
        "optimizer state damaged at its size",
        lambda c: _resume(c, damage=lambda c: _zero_bytes(_ckpt(c) / "optimizer.bin")),
        ("step-0000004", "the checkpoint does not load", "resume from an earlier one"),
    ),
    Case(
        "checkpoint",
        "changed lr",
        lambda c: _resume(c, "latest", "--lr", "1e-2"),
        ("lr: 0.003 there, 0.01 now", "--allow-config-change"),
    ),
    Case(
        "checkpoint",
        "changed batch size and policy",
        lambda c: _resume(c, "latest", "--batch-size", "16", "--policy", "bf16"),
        (
            "batch_size: '8' there, '16' now",
            "policy: 'fp32' there, 'bf16' now",
            "resolved_policy",
            "--allow-config-change",
        ),
    ),
    Case("checkpoint", "other data", _other_data, ("data_sha256:", "dataset:", "--allow-config-change")),
    Case(
        "checkpoint",
        "earlier checkpoint with later ones",
        lambda c: _resume(c, lambda c: _ckpt(c, 2)),
        ("later checkpoints exist (step-0000004)", "--resume-from latest", "--discard-later-checkpoints"),
    ),
    Case(
        "checkpoint",
        "another run's checkpoint into a run",
        _another_run_into_a_run,
        ("belongs to another run", "resume into an empty --output-dir"),
    ),
    Case(
        "checkpoint",
        "overwrite the checkpoint resumed from",
        lambda c: _resume(c, _ckpt, "--overwrite"),
        ("would delete the checkpoint you resume from", "drop --overwrite"),
    ),
]


OUTPUT = [
    Case(
        "output",
        "a directory of your files",
        lambda c: c.args(out=_user_dir(c)),
        ("holds files this recipe did not write (thesis.tex)", "choose an empty or new --output-dir"),
    ),
    Case(
        "output",
        "a directory of your files, --overwrite",
        lambda c: c.args("--overwrite", out=_user_dir(c)),
        ("--overwrite only removes files the recipe wrote itself",),
    ),
    Case(
        "output",
        "a file",
        lambda c: c.args(out=c.file("out", "x")),
        ("is a file, not a directory", "choose another --output-dir"),
    ),
    Case(
        "output",
        "under a file",
        lambda c: c.args(out=c.file("f", "x") / "sub"),
        ("f is a file, so no directory can be made there",),
    ),
    Case(
        "output",
        "a run, no flag",
        lambda c: c.args(out=c.run_copy()),
        ("already holds a run of this recipe", "--resume-from latest", "--overwrite", "another --output-dir"),
    ),
    Case(
        "output",
        "a run with a broken manifest",
        _broken_manifest,
        ("recipe_manifest.json is unreadable", "choose another --output-dir"),
    ),
    Case(
        "output",
        "overwrite and resume latest",
        lambda c: c.args("--overwrite", "--resume-from", "latest", out=c.run_copy()),
        ("overwrite=True with resume_from='latest' contradict each other", "pick one"),
    ),
    Case(
        "output",
        "a symlink to a directory of your files",
        lambda c: c.args(out=_link_to_user_dir(c)),
        ("holds files this recipe did not write (thesis.tex)",),
    ),
]


def _link_to_user_dir(ctx: Ctx) -> Path:
    _user_dir(ctx)
    link = ctx.dir / "link"
    link.symlink_to(ctx.out, target_is_directory=True)
    return link


TABLE = CONFIG + DATA + CHECKPOINT + OUTPUT


@pytest.fixture(scope="module")
def stopped_run(tiny_lm, tmp_path_factory) -> Path:
    """A run of 8 steps stopped after 4, with checkpoints at steps 2 and 4."""
    base = tmp_path_factory.mktemp("base") / "run"
    recipe = load_recipe()
    reset_accelerate()
    recipe.main([str(a) for a in lm_args(tiny_lm, base, "--max-steps", "8", "--save-every", "2", "--stop-after", "4")])
    reset_accelerate()
    return base


def test_bad_inputs_give_clear_errors_and_write_nothing(tiny_lm, stopped_run, tmp_path, capsys):
    recipe = load_recipe()
    base_before = snapshot(stopped_run)
    tried, clear, problems = Counter(), Counter(), []
    for i, case in enumerate(TABLE):
        ctx = Ctx(dir=tmp_path / f"case{i:03d}", tiny_lm=tiny_lm, base=stopped_run)
        ctx.dir.mkdir()
        argv = case.build(ctx)
        before = snapshot(ctx.dir)
        tried[case.area] += 1
        reset_accelerate()
        capsys.readouterr()
        try:
            recipe.main(argv)
            problems.append(f"[{case.area}] {case.name}: no error")
            continue
        except SystemExit as e:
            err = capsys.readouterr().err
            if not isinstance(e, recipe.RecipeError) or e.code != 2:
                problems.append(f"[{case.area}] {case.name}: exit {e.code!r} ({type(e).__name__}):\n{err[-1500:]}")
                continue
        except Exception as e:  # noqa: BLE001 - a traceback is exactly what this test is about
            problems.append(f"[{case.area}] {case.name}: {type(e).__name__}: {e}")
            continue
        missing = [f for f in case.expect if f not in err]
        if missing:
            problems.append(f"[{case.area}] {case.name}: message lacks {missing}:\n{err[-1500:]}")
        elif snapshot(ctx.dir) != before or snapshot(stopped_run) != base_before:
            problems.append(f"[{case.area}] {case.name}: files were written, changed or removed")
        else:
            clear[case.area] += 1
    reset_accelerate()
    total, ok = sum(tried.values()), sum(clear.values())
    print(
        f"\n{total} bad inputs, {ok} clear errors with nothing written or lost: "
        + ", ".join(f"{area} {clear[area]}/{tried[area]}" for area in ("config", "data", "checkpoint", "output"))
    )
    assert not problems, f"{len(problems)} of {total} bad inputs failed:\n" + "\n\n".join(problems)
    assert total >= 40 and min(tried.values()) >= 5
