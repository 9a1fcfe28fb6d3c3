"""The reader of the recipe's flags (flags.py: FinetuneConfig, by group): defaults <- ``--config``
YAML/JSON <- command line, through Transformers' ``HfArgumentParser`` (one ``--help`` group per
dataclass), every value's type checked."""

from __future__ import annotations

import argparse
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from hf_memstack.files import FileContentError, load_yaml, loads_json, read_regular

from .common import RecipeError, is_alias, looks_local, printable
from .flags import GROUP_OF, GROUPS, FinetuneConfig
from .safe_paths import name_max

PATH_FIELDS = ("dataset", "validation_file", "model", "tokenizer", "output_dir", "resume_from", "policy")


def parse_config(argv: list[str] | None = None, *, description: str | None = None) -> FinetuneConfig:
    """Defaults <- ``--config`` file (YAML or JSON) <- command line, through Transformers'
    ``HfArgumentParser`` (each field one flag, typed by its annotation), then every value checked.

    Raises:
        RecipeError: an unknown flag or field, a value of the wrong type, or a bad config file.
    """
    from transformers import HfArgumentParser

    from hf_memstack.cli.parser import negative_sizes_joined

    # '--memory-budget -1GiB' joined as '--memory-budget=-1GiB': argparse would read the size as a flag
    # ("expected one argument"); joined, the size check says what is wrong with it.
    argv = negative_sizes_joined(list(sys.argv[1:] if argv is None else argv), ("--memory-budget", "--memory_budget"))
    argv = _bare_packing_flag(argv)

    class Parser(HfArgumentParser):
        def error(self, message: str) -> typing.NoReturn:  # argparse would print usage and exit
            raise RecipeError(
                f"{message}; see --help for the flags"
                + (f" (values from --config {config_path})" if file_values else "")
            )

    # One dataclass per concern, one --help group each (their _argument_group_name); the flags' dests
    # stay the flat field names, so a --config file's flat keys are their defaults.
    parser = Parser(tuple(GROUPS.values()), description=description, formatter_class=_HelpFormatter)
    parser.add_argument("--config", help="a YAML or JSON file of FinetuneConfig fields; flags override it")
    config_path = _peek_config_flag(argv)
    file_values = _read_config_file(config_path) if config_path else {}
    if isinstance(file_values.get("packing"), bool):  # it was a switch: true is now 'on', false 'off'
        file_values["packing"] = "on" if file_values["packing"] else "off"
    # File values become the flags' defaults: a string (YAML reads '2e-4' as one) goes through the
    # flag's type like a command-line value; other values are checked against the annotation below.
    parser.set_defaults(**file_values)
    *groups, _config_flag, unknown = parser.parse_args_into_dataclasses(
        args=argv, look_for_args_file=False, return_remaining_strings=True
    )
    if unknown:
        flags = [a for a in parser._option_string_actions if a.startswith("--")]
        hints = [
            f"{a!r}"
            + (
                f" (did you mean {m[0]!r}?)"
                if a.startswith("-") and (m := difflib.get_close_matches(a.split("=")[0], flags, 1))
                else ""
            )
            for a in unknown
        ]
        raise RecipeError(f"unknown argument(s) {', '.join(hints)}; see --help for the flags")
    cfg = FinetuneConfig(**dict(zip(GROUPS, groups)))
    problems = _type_problems(cfg, source=f"--config {config_path}" if config_path else None)
    if problems:
        raise RecipeError("invalid configuration (nothing was loaded or written):\n  - " + "\n  - ".join(problems))
    _refuse_long_output_dir(cfg.output.output_dir)
    return _resolve_paths(_widen(cfg))


def _refuse_long_output_dir(value: str) -> None:
    """A folder name longer than a file name may be (255 bytes on most file systems) fails only when
    the first file is written, as 'OSError: File name too long'."""
    path = Path(value).expanduser()
    limit = name_max(path)
    long = [p for p in path.parts if len(p.encode("utf-8", "surrogateescape")) > limit]
    if long:
        raise RecipeError(
            f"output_dir: the folder name {printable(long[0][:40])!r}... is {len(long[0].encode('utf-8', 'surrogateescape'))} "
            f"bytes, longer than the {limit} bytes a file name may have there; choose a shorter --output-dir"
        )


def _bare_packing_flag(argv: list[str]) -> list[str]:
    """``--packing`` alone (it was a switch) means ``--packing on``."""
    return [
        f"{a}=on" if a == "--packing" and (i + 1 == len(argv) or argv[i + 1].startswith("-")) else a
        for i, a in enumerate(argv)
    ]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _peek_config_flag(argv: list[str]) -> str | None:
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--config")
    known, _ = peek.parse_known_args(argv)
    return known.config


def _read_config_file(path_str: str) -> dict[str, Any]:
    path = Path(path_str).expanduser()
    if not path.exists():
        raise RecipeError(
            f"--config {path_str!r}: no such file; pass a YAML or JSON file of FinetuneConfig fields (see --help)"
        )
    try:  # bounded, regular files only: a FIFO or /dev/zero is named, never read forever
        raw = read_regular(path, max_bytes=2**24)
    except (OSError, FileContentError) as e:
        raise RecipeError(f"--config {path_str!r}: cannot be read ({e}); pass a YAML or JSON file") from None
    where = f"--config {path_str}"
    try:  # no YAML aliases (a 417-byte alias bomb expands to 9**9 values), no nesting past the stack
        text = raw.decode("utf-8")
        values = loads_json(text, where=where) if path.suffix == ".json" else load_yaml(text, where=where)
    except UnicodeDecodeError as e:
        raise RecipeError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except FileContentError as e:
        raise RecipeError(f"{str(e)[:400]}; fix the file") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise RecipeError(
            f"--config {path_str}: holds a {type(values).__name__} ({str(values)[:40]!r}), not a mapping; "
            "write one 'field: value' per line, e.g. 'lr: 2.0e-4'"
        )
    names = list(GROUP_OF)
    unknown = [k for k in values if k not in names]
    if unknown:
        hints = [
            f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(str(k), names, 1)) else "")
            for k in unknown
        ]
        raise RecipeError(f"--config {path_str}: unknown field(s) {', '.join(hints)}; the fields are listed by --help")
    return values


def _allowed_types(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _fits(value: Any, kind: Any) -> bool:
    if kind is type(None):
        return value is None
    if typing.get_origin(kind) is Literal:
        return value in typing.get_args(kind)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:  # a number in a YAML file (batch_size: 32) is its text
        return isinstance(value, (str, int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _flag_types() -> dict[str, Any]:
    """Each flag's annotation, resolved, over every group."""
    return {name: hint for kind in GROUPS.values() for name, hint in typing.get_type_hints(kind).items()}


def _type_problems(cfg: FinetuneConfig, *, source: str | None) -> list[str]:
    """Values that arrived from a config file untyped by argparse (lists, nulls, mappings...)."""
    problems = []
    for name, hint in _flag_types().items():
        value = cfg.value(name)
        kinds = _allowed_types(hint)
        if not any(_fits(value, k) for k in kinds):
            allowed = " or ".join(
                repr(list(typing.get_args(k)))[1:-1]
                if typing.get_origin(k) is Literal
                else ("null" if k is type(None) else k.__name__)
                for k in kinds
            )
            problems.append(
                f"{name}={value!r} ({type(value).__name__}) must be {allowed}" + (f" (from {source})" if source else "")
            )
    return problems


def _widen(cfg: FinetuneConfig) -> FinetuneConfig:
    """Ints in float fields become floats, numbers in text fields become text (run_config.yaml reads back the same)."""
    changes = {}
    for name, hint in _flag_types().items():
        value, kinds = cfg.value(name), _allowed_types(hint)
        if float in kinds and isinstance(value, int):
            changes[name] = float(value)
        elif str in kinds and isinstance(value, (int, float)):
            changes[name] = str(value)
    return cfg.replaced(**changes)


def _resolve_paths(cfg: FinetuneConfig) -> FinetuneConfig:
    """Absolute paths, '~' expanded: './out' and 'out' are one run; run_config.yaml works from anywhere."""
    changes = {}
    for name in PATH_FIELDS:
        value = cfg.value(name)
        if value is None or (name == "resume_from" and value == "latest") or (name == "model" and is_alias(value)):
            continue
        if name == "policy" and not value.endswith((".yaml", ".yml")):
            continue
        if name in ("output_dir", "resume_from", "validation_file", "policy") or looks_local(value):
            changes[name] = str(Path(value).expanduser().resolve())
    return cfg.replaced(**changes)
