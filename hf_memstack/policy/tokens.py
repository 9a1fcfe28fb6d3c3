"""The policy string's grammar, in one table: each token is a spelling and the config fragment it
sets (``"ckpt:selective:alternate"`` -> ``checkpointing.mode="selective"``,
``checkpointing.selective_matmuls="save_alternate"``). Parsing (:func:`parse`), printing
(:func:`to_string`), the error messages and the token list of docs/policies.md all read :data:`TOKENS`.

Adding a token that maps to existing config is one row here. A new config field also needs its
dataclass field (``config.py``) and its validator (``validate.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, cast, get_args

from .config import MAX_EVERY_N, MAX_SEQUENCE_PARALLEL, SUBCONFIGS, Precision
from .presets import LADDER

__all__ = ["TOKENS", "Token", "listed_spellings", "parse", "to_string"]

# A token's fragment: the sub-config fields it sets (``{"mode": "every_n", "every_n": 2}``), or a
# plain field's value (``"bf16"`` for ``master_weights``).
Fields: TypeAlias = dict[str, str | bool | int]
Fragment: TypeAlias = Fields | str


@dataclass(frozen=True, slots=True)
class Token:
    """One spelling of the policy string and what it sets."""

    spelling: str
    """As written: ``"ckpt:offload"``; ``"ckpt:N"`` for the one that takes a number."""
    field: str
    """The :class:`MemoryPolicy` field it sets (``"checkpointing"``)."""
    fragment: Fragment
    """What it sets there: a dict of the sub-config's fields, or the value of a plain field
    (``master_weights``). Two tokens of one field go together only when their fragments set
    different sub-fields (``optim:8bit`` + ``optim:in_backward``)."""
    canonical: bool = True
    """``to_string`` writes this spelling for this fragment (False: an accepted alias)."""
    listed: bool = True
    """Error messages and docs/policies.md name it (False: an alias accepted quietly)."""
    number: Callable[[str], Fields | None] | None = None
    """For a spelling that takes a number (``ckpt:N``): the argument -> the fragment, or None."""
    number_field: str = ""
    """For a spelling that takes a number: the sub-config field ``to_string`` reads it from."""
    number_max: int = 0
    """For a spelling that takes a number: the largest it takes (error messages say the range)."""


def _every_n(arg: str) -> Fields | None:
    # ASCII digits only: '²'.isdigit() is True, and int('²') fails.
    return (
        {"mode": "every_n", "every_n": int(arg)}
        if re.fullmatch("[0-9]{1,6}", arg) and 2 <= int(arg) <= MAX_EVERY_N
        else None
    )


def _sp_size(arg: str) -> Fields | None:
    # ASCII digits only, as _every_n.
    return {"size": int(arg)} if re.fullmatch("[0-9]{1,6}", arg) and 2 <= int(arg) <= MAX_SEQUENCE_PARALLEL else None


TOKENS: tuple[Token, ...] = (
    Token("ckpt", "checkpointing", {"mode": "full"}),
    Token("ckpt:full", "checkpointing", {"mode": "full"}, canonical=False, listed=False),
    Token("ckpt:1", "checkpointing", {"mode": "full"}, canonical=False, listed=False),
    Token(
        "ckpt:N", "checkpointing", {"mode": "every_n"}, number=_every_n, number_field="every_n", number_max=MAX_EVERY_N
    ),
    Token("ckpt:offload", "checkpointing", {"mode": "offload"}),
    Token("ckpt:selective", "checkpointing", {"mode": "selective", "selective_matmuls": "save_all"}),
    Token("ckpt:selective:alternate", "checkpointing", {"mode": "selective", "selective_matmuls": "save_alternate"}),
    Token("compile", "compile", {"mode": "full"}),
    Token("compile:full", "compile", {"mode": "full"}, canonical=False, listed=False),
    Token("compile:regional", "compile", {"mode": "regional"}),
    # to_string writes full_shard's own name, as it always has.
    Token("fsdp", "fsdp", {"mode": "full_shard"}, canonical=False),
    Token("fsdp:full_shard", "fsdp", {"mode": "full_shard"}, listed=False),
    Token("fsdp:shard_grad_op", "fsdp", {"mode": "shard_grad_op"}),
    Token("fsdp:hybrid_shard", "fsdp", {"mode": "hybrid_shard"}),
    Token("fsdp:offload", "fsdp", {"mode": "full_shard", "cpu_offload": True}),
    Token("loss:chunked", "loss", {"mode": "chunked", "compiled": False}),
    Token("loss:chunked:compiled", "loss", {"mode": "chunked", "compiled": True}),
    Token("quant:nf4", "quant", {"mode": "nf4", "upcast": False}),
    Token("quant:nf4:upcast", "quant", {"mode": "nf4", "upcast": True}),
    Token("mlp:tiled", "mlp", {"mode": "tiled"}),
    Token("optim:8bit", "optimizer", {"state": "8bit"}),
    Token("optim:in_backward", "optimizer", {"step": "in_backward"}),
    Token("weights:fp32", "master_weights", "fp32", canonical=False),
    Token("weights:bf16", "master_weights", "bf16"),
    # Every size but 1 (off) is this token; to_string only reaches it for a size that is not 1.
    Token("sp:N", "sequence_parallel", {}, number=_sp_size, number_field="size", number_max=MAX_SEQUENCE_PARALLEL),
)
"""Every token but the precision (``fp32``, ``bf16``, ``fp16``, ``auto``: the string's first word)."""

_BY_SPELLING = {t.spelling: t for t in TOKENS if t.number is None}
_GROUPS = tuple(dict.fromkeys(t.spelling.partition(":")[0] for t in TOKENS))  # ckpt, compile, fsdp, ...


def listed_spellings(group: str | None = None) -> list[str]:
    """The spellings error messages name (of one group, e.g. ``"ckpt"``), in the table's order."""
    return [t.spelling for t in TOKENS if t.listed and (group is None or t.spelling.partition(":")[0] == group)]


def _allowed(group: str) -> str:
    return ", ".join(
        f"'{t.spelling}'" + (f" (2 <= N <= {t.number_max})" if t.number is not None else "")
        for t in TOKENS
        if t.listed and t.spelling.partition(":")[0] == group
    )


def _lookup(token: str) -> tuple[str, Fragment] | None:
    """The field a spelling sets and its fragment (a number token's built from its argument), or None."""
    if token in _BY_SPELLING:
        return _BY_SPELLING[token].field, _BY_SPELLING[token].fragment
    group, _, arg = token.partition(":")
    for t in TOKENS:
        if t.number is not None and t.spelling.partition(":")[0] == group and (fragment := t.number(arg)) is not None:
            return t.field, fragment
    return None


def parse(spec: str) -> tuple[dict[str, Any], list[str]]:
    """``"bf16+ckpt+optim:8bit"`` -> the :class:`MemoryPolicy` keyword arguments, and the problems
    (each naming the string, the token and what is allowed). Presets are expanded first."""
    original = spec
    spec = LADDER.get(spec.strip().lower(), spec).strip().lower()
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    set_by: dict[tuple[str, str], str] = {}  # (field, sub-field) -> the token that set it
    for raw in spec.split("+"):
        token = raw.strip()
        name, _, arg = token.partition(":")
        if name in get_args(Precision):
            if ("precision", "") in set_by:
                problems.append(_conflict(original, token, set_by[("precision", "")]))
                continue
            set_by[("precision", "")] = token
            if arg:
                problems.append(f"policy string {original!r}: precision {name!r} takes no ':' argument")
            kwargs["precision"] = name
            continue
        found = _lookup(token)
        if found is None:
            problems.append(
                _unknown(original, token)
                if name not in _GROUPS
                else f"policy string {original!r}: {token!r} is not one of {_allowed(name)}"
            )
            continue
        field, fragment = found
        keys = list(fragment) if isinstance(fragment, dict) else [""]
        # One token a field, but the optimizer's two set different sub-fields and may go together.
        clash = next((t for (f, k), t in set_by.items() if f == field and (field != "optimizer" or k in keys)), None)
        if clash is not None:
            problems.append(_conflict(original, token, clash))
            continue
        set_by.update({(field, k): token for k in keys})
        kwargs[field] = {**kwargs.get(field, {}), **fragment} if isinstance(fragment, dict) else fragment
    problems += _preset_name_problems(original, [raw.strip() for raw in spec.split("+")], set_by)
    # Sub-config fragments become their dataclasses (validated when the policy is built).
    return {k: SUBCONFIGS[k](**v) if k in SUBCONFIGS else v for k, v in kwargs.items()}, problems


def _preset_name_problems(original: str, words: list[str], set_by: Mapping[tuple[str, str], str]) -> list[str]:
    """A preset whose name is a token of its own (``fsdp``: the preset ``bf16+ckpt+fsdp``, and the FSDP
    token) joined with other tokens in a string that names no precision: the token's reading trains
    in fp32 without the preset's checkpointing, the preset's in bf16 with it - refused, naming both
    (a string naming its precision, as the planner and the docs write them, is read token by token)."""
    if len(words) < 2 or ("precision", "") in set_by:
        return []
    problems = []
    for name, expansion in LADDER.items():
        others = [w for w in words if w != name]
        if (
            name == expansion
            or name not in words
            or any(not _settings(w) or _settings(name) & _settings(w) for w in others)
        ):
            continue  # not such a preset, not in the string, or beside an unknown word or a conflict (said already)
        field, fragment = _BY_SPELLING[name].field, cast(Fields, _BY_SPELLING[name].fragment)  # a preset's: fields
        sets = ", ".join(f"policy.{field}.{k}={v!r}" for k, v in fragment.items())
        problems.append(
            f"policy string {original!r}: {name!r} alone is the preset {expansion!r}, but joined with other tokens it "
            f"is the token {name!r} only ({sets}), and this string names no precision: it would train in "
            f"fp32 without the preset's other settings. Write {_with_preset(expansion, others)!r} for the preset "
            f"with {'+'.join(others)!r}, or {'+'.join(['fp32', *words])!r} for the tokens as written, in fp32"
        )
    return problems


def _with_preset(expansion: str, additions: list[str]) -> str:
    """The preset's tokens and ``additions``, an addition taking the place of the preset's token that
    sets the same settings (``ckpt:2`` for ``ckpt``); one it already holds is not written twice."""
    words = expansion.split("+")
    for word in additions:
        at = next((i for i, w in enumerate(words) if _settings(w) & _settings(word)), None)
        if at is None:
            words.append(word)
        else:
            words[at] = word
    return "+".join(dict.fromkeys(words))


def _settings(word: str) -> set[tuple[str, str]]:
    """What a word sets: (field, sub-field) pairs, ``("precision", "")`` for a precision; none for a
    word that is no token."""
    if word.partition(":")[0] in get_args(Precision):
        return {("precision", "")}
    found = _lookup(word)
    if found is None:
        return set()
    field, fragment = found
    return {(field, k) for k in fragment} if isinstance(fragment, dict) else {(field, "")}


def _conflict(original: str, token: str, earlier: str) -> str:
    return (
        f"policy string {original!r}: {token!r} conflicts with {earlier!r}; give each of precision, "
        f"{', '.join(_GROUPS[:-1])} and {_GROUPS[-1]} at most once (optim:8bit and optim:in_backward may go together)"
    )


def _unknown(original: str, token: str) -> str:
    return (
        f"policy string {original!r}: unknown token {token!r}; allowed: a precision ({', '.join(get_args(Precision))}), "
        f"{', '.join(_allowed(g) for g in _GROUPS)}, or a preset ({', '.join(LADDER)})"
    )


def _holds(value: object, fragment: Fragment) -> bool:
    """Whether a field's value has every setting of a token's fragment."""
    if not isinstance(fragment, dict):
        return value == fragment
    return all(getattr(value, k) == v for k, v in fragment.items())


def to_string(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """The shortest string for a policy's field ``values``: its precision, then for each field not
    at its default the canonical token that says the most of it (the optimizer: every one it
    holds), in the table's order. Options without a token (a chunk size, an inductor mode, CPU
    offload of a mode other than full_shard) are left out."""
    parts = [values["precision"]]
    for name in dict.fromkeys(t.field for t in TOKENS):
        value = values[name]
        if value == defaults[name]:
            continue
        held = [t for t in TOKENS if t.field == name and t.canonical and _holds(value, t.fragment)]
        numbered = next((t for t in held if t.number is not None), None)
        if numbered is not None:  # ckpt:N, sp:N
            parts.append(f"{numbered.spelling.partition(':')[0]}:{getattr(value, numbered.number_field)}")
        elif name == "optimizer":  # its tokens set different sub-fields
            parts += [t.spelling for t in held]
        elif held:
            parts.append(max(held, key=lambda t: len(t.fragment) if isinstance(t.fragment, dict) else 1).spelling)
    return "+".join(parts)
