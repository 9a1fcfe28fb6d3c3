"""The data: read and check the rows (local files or the hub), tokenize, pack and collate them."""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .common import FORMATS, RecipeError, looks_local
from .config import FinetuneConfig


@dataclass
class Rows:
    """One data file read and checked: its rows (only the fields the task uses), where each row is, its digest."""

    rows: list[dict[str, Any]]
    where: list[str]  # "line 7" / "item 3": for messages
    source: str
    sha256: str


def _utf8(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise RecipeError(
            f"{source}, line {line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {column}); "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def read_rows(path: Path) -> Rows:
    """Rows of a local file with their positions, and the file's sha256. JSON lines, a JSON array,
    CSV (header row), parquet, or text (one row per non-empty line, field 'text').

    Raises:
        RecipeError: not UTF-8, not valid JSON/CSV, a row that is not an object, an empty file;
            the message names the file and the line.
    """
    source = str(path)
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    kind = FORMATS[path.suffix]
    rows: list[Any] = []
    where: list[str] = []
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(io.BytesIO(raw)).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid family for broken files
            raise RecipeError(
                f"{source}: not a readable parquet file ({type(e).__name__}: {str(e)[:160]}); rewrite it"
            ) from None
        where = [f"row {i + 1}" for i in range(len(rows))]
    elif kind == "text":
        for n, line in enumerate(_utf8(raw, source).splitlines(), 1):
            if line.strip():
                rows.append({"text": line})
                where.append(f"line {n}")
    elif kind == "csv":
        import csv

        reader = csv.DictReader(io.StringIO(_utf8(raw, source), newline=""))
        try:
            for row in reader:
                if None in row:
                    raise RecipeError(
                        f"{source}, line {reader.line_num}: more values than the header's "
                        f"{len(reader.fieldnames or [])} columns; quote values that contain commas"
                    )
                rows.append(row)
                where.append(f"line {reader.line_num}")
        except csv.Error as e:
            raise RecipeError(f"{source}, line {reader.line_num}: not valid CSV ({e}); fix the line") from None
    else:
        text = _utf8(raw, source)
        if text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise RecipeError(
                    f"{source}, line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}); fix the file"
                ) from None
            where = [f"item {i + 1}" for i in range(len(rows))]
        else:
            for n, line in enumerate(text.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise RecipeError(
                        f"{source}, line {n}: not valid JSON ({e.msg} at column {e.colno}); "
                        'each line must be one JSON object such as {"text": "...", "label": 0}'
                    ) from None
                where.append(f"line {n}")
    for row, at in zip(rows, where):
        if not isinstance(row, dict):
            raise RecipeError(
                f"{source}, {at}: a JSON {type(row).__name__} where a row object belongs; "
                'each row must be an object such as {"text": "..."}'
            )
    if not rows:
        raise RecipeError(f"{source}: has no rows; give a file with at least 2 rows (one is carved off for validation)")
    return Rows(rows=rows, where=where, source=source, sha256=digest)


def _check_rows(data: Rows, fields: list[str], *, label_field: str | None, first_label: dict[str, Any]) -> list[str]:
    """Every row has every field as non-empty text, and the label as an int or a string, one type
    for all (``first_label`` carries the first label's type and place across files)."""
    problems = []
    for row, at in zip(data.rows, data.where):
        for name in fields:
            value = row.get(name)
            if name == label_field:
                if value is None or isinstance(value, float) or not isinstance(value, (int, str)):
                    problems.append(
                        f"{data.source}, {at}: field {name!r} is {'missing' if name not in row else repr(value)}; "
                        "every row needs a label, an integer or a string"
                    )
                    continue
                kind = type(value)
                if not first_label:
                    first_label.update(kind=kind, at=f"{data.source}, {at}")
                elif kind is not first_label["kind"]:
                    problems.append(
                        f"{data.source}, {at}: field {name!r} is {value!r} ({kind.__name__}) but the label at "
                        f"{first_label['at']} is a {first_label['kind'].__name__}; use one type for every label "
                        "(all integers or all strings)"
                    )
            elif not isinstance(value, str) or not value.strip():
                problems.append(
                    f"{data.source}, {at}: field {name!r} is {'missing' if name not in row else repr(value)}; "
                    f"every row needs non-empty text in {name!r} (the row's fields: {sorted(row)})"
                )
        if len(problems) >= 5:
            problems.append("(stopped after 5 problems)")
            break
    return problems


def load_raw_data(cfg: FinetuneConfig) -> tuple[Any, Any, str, str]:
    """Train and validation splits (datasets.Dataset), the task, and a digest of the data.

    Raises:
        RecipeError: the file, the row and the field of the first problems found.
    """
    import datasets

    datasets.disable_progress_bars()
    if not looks_local(cfg.dataset):
        return _load_hub_data(cfg)
    train = read_rows(Path(cfg.dataset))
    val = read_rows(Path(cfg.validation_file)) if cfg.validation_file else None
    if val is None:
        # The same rule as datasets' train_test_split: ceil for the validation part, floor for the training part.
        n = len(train.rows)
        n_val, n_train = math.ceil(cfg.validation_split * n), math.floor((1 - cfg.validation_split) * n)
        if n_train < 1 or n_val < 1 or n_train + n_val > n:
            raise RecipeError(
                f"{cfg.dataset}: has {n} row(s); carving off validation_split={cfg.validation_split} for "
                "validation leaves no training row; add rows, lower --validation-split or pass --validation-file"
            )
    task = cfg.task
    if task == "auto":
        has_label = any(cfg.label_field in r for r in train.rows)
        task = "classification" if has_label and cfg.prompt_field is None else "causal-lm"
    if task == "classification":
        needed = [cfg.text_field, cfg.label_field]
    elif cfg.prompt_field:
        needed = [cfg.prompt_field, cfg.response_field]
    else:
        needed = [cfg.text_field]
    parts = [train] + ([val] if val else [])
    if task == "classification":
        for part in parts:
            if part.source.endswith(
                ".csv"
            ):  # CSV has no types: integer-looking labels are integers, as datasets reads them
                if all(
                    isinstance(r.get(cfg.label_field), str) and re.fullmatch(r"-?\d+", r[cfg.label_field])
                    for r in part.rows
                ):
                    for r in part.rows:
                        r[cfg.label_field] = int(r[cfg.label_field])
    problems: list[str] = []
    first_label: dict[str, Any] = {}
    for part in parts:
        problems += _check_rows(
            part, needed, label_field=cfg.label_field if task == "classification" else None, first_label=first_label
        )
    if task == "classification" and not problems:
        labels = {r[cfg.label_field] for r in train.rows}
        if len(labels) < 2:
            problems.append(
                f"{cfg.dataset}: field {cfg.label_field!r} has one value ({next(iter(labels))!r}) in every row; "
                "classification needs at least 2 classes"
            )
    if problems:
        raise RecipeError("the data cannot be used (nothing was written):\n  - " + "\n  - ".join(problems))
    train_ds = datasets.Dataset.from_list([{k: r[k] for k in needed} for r in train.rows])
    if val is not None:
        val_ds = datasets.Dataset.from_list([{k: r[k] for k in needed} for r in val.rows])
    else:
        split = train_ds.train_test_split(test_size=cfg.validation_split, seed=cfg.seed)
        train_ds, val_ds = split["train"], split["test"]
    digest = hashlib.sha256((train.sha256 + (val.sha256 if val else "")).encode()).hexdigest()
    return train_ds, val_ds, task, digest


def _load_hub_data(cfg: FinetuneConfig) -> tuple[Any, Any, str, str]:
    import datasets

    try:
        data = datasets.load_dataset(cfg.dataset)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated: say which and how to fix
        raise RecipeError(
            f"dataset={cfg.dataset!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}); "
            "pass a local file or check the id and the network"
        ) from None
    train = data["train"]
    if "validation" in data:
        val = data["validation"]
    else:
        split = train.train_test_split(test_size=cfg.validation_split, seed=cfg.seed)
        train, val = split["train"], split["test"]
    task = cfg.task
    if task == "auto":
        task = "classification" if cfg.label_field in train.column_names and cfg.prompt_field is None else "causal-lm"
    needed = (
        [cfg.text_field, cfg.label_field]
        if task == "classification"
        else ([cfg.prompt_field, cfg.response_field] if cfg.prompt_field else [cfg.text_field])
    )
    missing = [f for f in needed if f not in train.column_names]
    if missing:
        raise RecipeError(
            f"dataset {cfg.dataset}: field(s) {missing} not in the data; its columns are {train.column_names}. "
            "Pass --text-field/--label-field/--prompt-field/--response-field"
        )
    return train, val, task, f"hub:{cfg.dataset}:{train._fingerprint}:{val._fingerprint}"


def tokenize(train: Any, val: Any, task: str, tokenizer: Any, cfg: FinetuneConfig) -> tuple[Any, Any, int]:
    """Token ids (and labels) for each split; returns the number of classes for classification.

    Raises:
        RecipeError: a row left with nothing to learn (a prompt longer than --seq-len, no full packed block).
    """
    if task == "classification":
        labels = sorted(set(train[cfg.label_field]) | set(val[cfg.label_field]))
        index = {v: i for i, v in enumerate(labels)}

        def enc(rows: dict) -> dict:
            out = tokenizer(rows[cfg.text_field], truncation=True, max_length=cfg.seq_len)
            out["labels"] = [index[v] for v in rows[cfg.label_field]]
            return out

        cols = train.column_names
        return (
            train.map(enc, batched=True, remove_columns=cols),
            val.map(enc, batched=True, remove_columns=cols),
            len(labels),
        )

    if cfg.seq_len < 2:
        raise RecipeError(
            f"seq_len={cfg.seq_len}: a causal LM needs at least 2 tokens per sample (one to predict); use --seq-len 2 or more"
        )
    eos = tokenizer.eos_token or ""
    if cfg.prompt_field:

        def enc(rows: dict) -> dict:
            ids, labels = [], []
            for prompt, response in zip(rows[cfg.prompt_field], rows[cfg.response_field]):
                if tokenizer.chat_template:
                    p = tokenizer.apply_chat_template(
                        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
                    )
                else:
                    p = prompt + "\n"
                p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
                r_ids = tokenizer(response + eos, add_special_tokens=False)["input_ids"]
                ids.append((p_ids + r_ids)[: cfg.seq_len])
                # The loss is on the response only: prompt positions are -100.
                labels.append(([-100] * len(p_ids) + r_ids)[: cfg.seq_len])
            return {"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids], "labels": labels}
    elif cfg.packing == "wrapped":

        def enc(rows: dict) -> dict:
            stream = [
                t for text in rows[cfg.text_field] for t in tokenizer(text + eos, add_special_tokens=False)["input_ids"]
            ]
            n = len(stream) // cfg.seq_len * cfg.seq_len
            blocks = [stream[i : i + cfg.seq_len] for i in range(0, n, cfg.seq_len)]
            return {
                "input_ids": blocks,
                "attention_mask": [[1] * cfg.seq_len for _ in blocks],
                "labels": [list(b) for b in blocks],
            }
    else:

        def enc(rows: dict) -> dict:
            out = tokenizer([t + eos for t in rows[cfg.text_field]], truncation=True, max_length=cfg.seq_len)
            out["labels"] = [list(x) for x in out["input_ids"]]
            return out

    cols = train.column_names
    train_ds, val_ds = (
        train.map(enc, batched=True, remove_columns=cols),
        val.map(enc, batched=True, remove_columns=cols),
    )
    _check_learnable(train_ds, val_ds, cfg)
    if cfg.packing == "on":
        train_ds, val_ds = pack_rows(train_ds, cfg), pack_rows(val_ds, cfg)
    return train_ds, val_ds, 0


def pack_rows(ds: Any, cfg: FinetuneConfig) -> Any:
    """Whole samples packed into rows of --seq-len tokens (hf_memstack.data.pack_dataset: best-fit
    decreasing; no sample is split, each is at most --seq-len tokens already)."""
    from hf_memstack.data import pack_dataset

    return pack_dataset(ds, cfg.seq_len)


def packing_summary(packed: Any, cfg: FinetuneConfig) -> str:
    """The training rows' padding packed (rows padded to --seq-len) against the same samples in
    padded batches (each padded to its longest sample, at --batch-size or 8 with --batch-size auto)."""
    from hf_memstack.data import padding_stats

    lengths = [n for row in packed["seq_lengths"] for n in row]
    tokens, slots = sum(lengths), len(packed) * cfg.seq_len
    batch = int(cfg.batch_size) if cfg.batch_size.isdigit() else 8
    padded = padding_stats(lengths, batch, seed=cfg.seed)
    return (
        f"packing: {len(lengths)} training samples ({tokens} tokens) in {len(packed)} rows of {cfg.seq_len}: "
        f"{1 - tokens / slots:.1%} padding, against {padded.padding_fraction:.1%} in padded batches of {batch}"
    )


def _check_learnable(train_ds: Any, val_ds: Any, cfg: FinetuneConfig) -> None:
    """Rows with nothing to learn: no full wrapped block, a prompt filling all --seq-len tokens."""
    for name, ds in (("training", train_ds), ("validation", val_ds)):
        if len(ds) == 0:
            raise RecipeError(
                f"packing: the {name} texts hold fewer than --seq-len={cfg.seq_len} tokens in all; "
                "lower --seq-len or add text"
            )
        if cfg.prompt_field:
            empty = [i for i, labels in enumerate(ds["labels"]) if all(t == -100 for t in labels[1:])]
            if empty:
                raise RecipeError(
                    f"{name} row {empty[0] + 1}: the prompt fills all --seq-len={cfg.seq_len} tokens, "
                    f"no response token is left to learn ({len(empty)} such row(s)); raise --seq-len or shorten the prompts"
                )


def collate(tokenizer: Any, pad_to: int | None = None, *, packed: bool = False):
    """Pad a list of samples into a batch; labels are padded with -100 (ignored by the loss). Packed
    rows (--packing on) go through hf_memstack.data.PackedCollator: position_ids restarting at each
    sample and no attention_mask (a 2-D mask would let the samples attend to each other)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if packed:
        from hf_memstack.data import PackedCollator

        return PackedCollator(pad_token_id=pad_id, pad_to=pad_to)

    def fn(samples: list[dict]) -> dict[str, torch.Tensor]:
        width = pad_to or max(len(s["input_ids"]) for s in samples)
        batch = {
            "input_ids": torch.tensor([s["input_ids"] + [pad_id] * (width - len(s["input_ids"])) for s in samples]),
            "attention_mask": torch.tensor(
                [s["attention_mask"] + [0] * (width - len(s["attention_mask"])) for s in samples]
            ),
        }
        if isinstance(samples[0]["labels"], list):
            batch["labels"] = torch.tensor([s["labels"] + [-100] * (width - len(s["labels"])) for s in samples])
        else:
            batch["labels"] = torch.tensor([s["labels"] for s in samples])
        return batch

    return fn
