"""The data: the splits and the task from the rows (local files, read by rows.py, or the hub),
tokenized, packed and collated."""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from .common import RecipeError, looks_local, printable
from .flags import FinetuneConfig
from .rows import FirstLabel, Rows, check_rows, read_rows

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from collections.abc import Callable

    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

    from hf_memstack.data import LabelFraction

    from .common import Batch, Collate, Sample

    # A batched ``Dataset.map`` function: a batch of rows, column by column, to the new columns.
    Encoder = Callable[[dict[str, list[Any]]], dict[str, list[Any]]]


def load_raw_data(cfg: FinetuneConfig) -> tuple[Dataset, Dataset, str, str]:
    """Train and validation splits (datasets.Dataset), the task, and a digest of the data.

    Raises:
        RecipeError: the file, the row and the field of the first problems found.
    """
    import datasets

    datasets.disable_progress_bars()
    if not looks_local(cfg.data.dataset):
        return _load_hub_data(cfg)
    train = read_rows(Path(cfg.data.dataset))
    val = read_rows(Path(cfg.data.validation_file)) if cfg.data.validation_file else None
    if val is None:
        _check_split(cfg, len(train.rows))
    task = cfg.data.task
    if task == "auto":
        has_label = any(cfg.data.label_field in r for r in train.rows)
        task = "classification" if has_label and cfg.data.prompt_field is None else "causal-lm"
    needed = _needed_fields(cfg, task)
    parts = [train] + ([val] if val else [])
    if task == "classification":
        for part in parts:
            if part.source.endswith(".csv"):
                _integer_csv_labels(part, cfg.data.label_field)
    problems = _problems(cfg, task, parts, needed)
    if problems:
        raise RecipeError("the data cannot be used (nothing was written):\n  - " + "\n  - ".join(problems))
    train_ds = datasets.Dataset.from_list([{k: r[k] for k in needed} for r in train.rows])
    if val is not None:
        val_ds = datasets.Dataset.from_list([{k: r[k] for k in needed} for r in val.rows])
    else:
        split = train_ds.train_test_split(test_size=cfg.data.validation_split, seed=cfg.train.seed)
        train_ds, val_ds = split["train"], split["test"]
    digest = hashlib.sha256((train.sha256 + (val.sha256 if val else "")).encode()).hexdigest()
    return train_ds, val_ds, task, digest


def _check_split(cfg: FinetuneConfig, n: int) -> None:
    """Carving off --validation-split leaves a row on each side."""
    # The same rule as datasets' train_test_split: ceil for the validation part, floor for the training part.
    n_val, n_train = math.ceil(cfg.data.validation_split * n), math.floor((1 - cfg.data.validation_split) * n)
    if n_train < 1 or n_val < 1 or n_train + n_val > n:
        raise RecipeError(
            f"{cfg.data.dataset}: has {n} row(s); carving off validation_split={cfg.data.validation_split} for "
            "validation leaves no training row; add rows, lower --validation-split or pass --validation-file"
        )


def _needed_fields(cfg: FinetuneConfig, task: str) -> list[str]:
    """The fields the task reads from every row."""
    if task == "classification":
        return [cfg.data.text_field, cfg.data.label_field]
    if cfg.data.prompt_field:
        return [cfg.data.prompt_field, cfg.data.response_field]
    return [cfg.data.text_field]


def _integer_csv_labels(part: Rows, label_field: str) -> None:
    """CSV has no types: integer-looking labels are integers, as datasets reads them."""
    if all(isinstance(r.get(label_field), str) and re.fullmatch(r"-?\d+", r[label_field]) for r in part.rows):
        for r in part.rows:
            r[label_field] = int(r[label_field])


def _problems(cfg: FinetuneConfig, task: str, parts: list[Rows], needed: list[str]) -> list[str]:
    """The first problems of the rows' fields, across files; a classifier also needs 2 classes."""
    problems: list[str] = []
    first_label: FirstLabel = {}
    for part in parts:
        problems += check_rows(
            part,
            needed,
            label_field=cfg.data.label_field if task == "classification" else None,
            first_label=first_label,
        )
    if task == "classification" and not problems:
        labels = {r[cfg.data.label_field] for r in parts[0].rows}
        if len(labels) < 2:
            problems.append(
                f"{cfg.data.dataset}: field {cfg.data.label_field!r} has one value ({next(iter(labels))!r}) in "
                "every row; "
                "classification needs at least 2 classes"
            )
    return problems


def _load_hub_data(cfg: FinetuneConfig) -> tuple[Dataset, Dataset, str, str]:
    import datasets

    try:
        data = datasets.load_dataset(cfg.data.dataset)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated: say which and how to fix
        raise RecipeError(
            f"dataset={cfg.data.dataset!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}); "
            "pass a local file or check the id and the network"
        ) from None
    train = data["train"]
    if "validation" in data:
        val = data["validation"]
    else:
        split = train.train_test_split(test_size=cfg.data.validation_split, seed=cfg.train.seed)
        train, val = split["train"], split["test"]
    task = cfg.data.task
    if task == "auto":
        task = (
            "classification"
            if cfg.data.label_field in train.column_names and cfg.data.prompt_field is None
            else "causal-lm"
        )
    needed = _needed_fields(cfg, task)
    missing = [f for f in needed if f not in train.column_names]
    if missing:
        raise RecipeError(
            f"dataset {cfg.data.dataset}: field(s) {missing} not in the data; its columns are {train.column_names}. "
            "Pass --text-field/--label-field/--prompt-field/--response-field"
        )
    return train, val, task, f"hub:{cfg.data.dataset}:{train._fingerprint}:{val._fingerprint}"


def tokenize(
    train: Dataset, val: Dataset, task: str, tokenizer: PreTrainedTokenizerBase, cfg: FinetuneConfig
) -> tuple[Dataset, Dataset, int]:
    """Token ids (and labels) for each split; returns the number of classes for classification.

    Raises:
        RecipeError: a row left with nothing to learn (a prompt longer than --seq-len, no full packed block).
    """
    if task == "classification":
        labels = sorted(set(train[cfg.data.label_field]) | set(val[cfg.data.label_field]))
        index = {v: i for i, v in enumerate(labels)}

        def enc(rows: dict) -> dict:
            out = tokenizer(rows[cfg.data.text_field], truncation=True, max_length=cfg.data.seq_len)
            out["labels"] = [index[v] for v in rows[cfg.data.label_field]]
            return out

        cols = train.column_names
        return (
            train.map(enc, batched=True, remove_columns=cols),
            val.map(enc, batched=True, remove_columns=cols),
            len(labels),
        )

    if cfg.data.seq_len < 2:
        raise RecipeError(
            f"seq_len={cfg.data.seq_len}: a causal LM needs at least 2 tokens per sample (one to predict); use "
            "--seq-len 2 or more"
        )
    encode = _lm_encoder(cfg, tokenizer)
    cols = train.column_names
    train_ds, val_ds = (
        train.map(encode, batched=True, remove_columns=cols),
        val.map(encode, batched=True, remove_columns=cols),
    )
    _check_learnable(train_ds, val_ds, cfg)
    if cfg.data.packing == "on":
        train_ds, val_ds = pack_rows(train_ds, cfg), pack_rows(val_ds, cfg)
    return train_ds, val_ds, 0


def training_label_fraction(
    train: Dataset, task: str, tokenizer: PreTrainedTokenizerBase, cfg: FinetuneConfig, rows: int = 512
) -> LabelFraction | None:
    """The share of the training positions whose label carries loss (the rows ``loss:chunked`` runs
    its head over): at most ``rows`` raw rows spread over the split, tokenized (and packed) as
    training tokenizes them, for the planner. None for a classifier (one label a row, no head over
    tokens), and for rows with nothing to learn, which :func:`tokenize` refuses with its own message."""
    from hf_memstack.data import measure_label_fraction

    if task != "causal-lm" or len(train) == 0 or cfg.data.seq_len < 2:
        return None
    n = min(len(train), rows)
    sample = train.select(sorted({i * len(train) // n for i in range(n)}))
    encoded = sample.map(
        _lm_encoder(cfg, tokenizer), batched=True, remove_columns=sample.column_names, keep_in_memory=True
    )
    if cfg.data.packing == "on":
        encoded = pack_rows(encoded, cfg)
    try:
        return measure_label_fraction(encoded, max_rows=rows)
    except ValueError:
        return None


def _lm_encoder(cfg: FinetuneConfig, tokenizer: PreTrainedTokenizerBase) -> Encoder:
    """The batched ``map`` function of a causal LM's rows: a prompt and its response (the loss on
    the response only), --packing wrapped's blocks of --seq-len tokens, or one text a row."""
    eos = tokenizer.eos_token or ""
    if cfg.data.prompt_field:

        def enc(rows: dict) -> dict:
            ids, labels = [], []
            for prompt, response in zip(rows[cfg.data.prompt_field], rows[cfg.data.response_field]):
                if tokenizer.chat_template:
                    p = _chat_prompt(tokenizer, prompt)
                else:
                    p = prompt + "\n"
                p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
                r_ids = tokenizer(response + eos, add_special_tokens=False)["input_ids"]
                ids.append((p_ids + r_ids)[: cfg.data.seq_len])
                # The loss is on the response only: prompt positions are -100.
                labels.append(([-100] * len(p_ids) + r_ids)[: cfg.data.seq_len])
            return {"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids], "labels": labels}
    elif cfg.data.packing == "wrapped":

        def enc(rows: dict) -> dict:
            stream = [
                t
                for text in rows[cfg.data.text_field]
                for t in tokenizer(text + eos, add_special_tokens=False)["input_ids"]
            ]
            n = len(stream) // cfg.data.seq_len * cfg.data.seq_len
            blocks = [stream[i : i + cfg.data.seq_len] for i in range(0, n, cfg.data.seq_len)]
            return {
                "input_ids": blocks,
                "attention_mask": [[1] * cfg.data.seq_len for _ in blocks],
                "labels": [list(b) for b in blocks],
            }
    else:

        def enc(rows: dict) -> dict:
            out = tokenizer([t + eos for t in rows[cfg.data.text_field]], truncation=True, max_length=cfg.data.seq_len)
            out["labels"] = [list(x) for x in out["input_ids"]]
            return out

    return enc


def _chat_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """The prompt as the tokenizer's chat template writes a user turn (Transformers renders it in
    Jinja's sandbox, which refuses a template reaching for Python internals such as ``__class__``).

    Raises:
        RecipeError: the template fails or is refused, naming the file it came from.
    """
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError

    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return cast(str, text)  # tokenize=False: the rendered text
    except TemplateError as e:
        source = Path(tokenizer.name_or_path)
        field = (
            f"{source / 'chat_template.jinja'}"
            if (source / "chat_template.jinja").is_file()
            else f"{source / 'tokenizer_config.json'}'s chat_template"
        )
        why = (
            "was refused by Jinja's sandbox for reaching for Python internals (a chat template only formats "
            "messages; this one tried more, and nothing of it ran)"
            if isinstance(e, SecurityError)
            else "fails"
        )
        raise RecipeError(
            f"the chat template in {printable(field)} {why} ({type(e).__name__}: {printable(str(e)[:200])}); "
            "fix or remove that template, or pass --tokenizer with a tokenizer whose template works"
        ) from None


def pack_rows(ds: Dataset, cfg: FinetuneConfig) -> Dataset:
    """Whole samples packed into rows of --seq-len tokens (hf_memstack.data.pack_dataset: best-fit
    decreasing; no sample is split, each is at most --seq-len tokens already)."""
    from hf_memstack.data import pack_dataset

    return pack_dataset(ds, cfg.data.seq_len)


def packing_summary(packed: Dataset, cfg: FinetuneConfig) -> str:
    """The training rows' padding packed (rows padded to --seq-len) against the same samples in
    padded batches (each padded to its longest sample, at --batch-size or 8 with --batch-size auto)."""
    from hf_memstack.data import padding_stats

    lengths = [n for row in packed["seq_lengths"] for n in row]
    tokens, slots = sum(lengths), len(packed) * cfg.data.seq_len
    batch = int(cfg.memory.batch_size) if cfg.memory.batch_size.isdigit() else 8
    padded = padding_stats(lengths, batch, seed=cfg.train.seed)
    return (
        f"packing: {len(lengths)} training samples ({tokens} tokens) in {len(packed)} rows of {cfg.data.seq_len}: "
        f"{1 - tokens / slots:.1%} padding, against {padded.padding_fraction:.1%} in padded batches of {batch}"
    )


def _check_learnable(train_ds: Dataset, val_ds: Dataset, cfg: FinetuneConfig) -> None:
    """Rows with nothing to learn: no full wrapped block, a prompt filling all --seq-len tokens."""
    for name, ds in (("training", train_ds), ("validation", val_ds)):
        if len(ds) == 0:
            raise RecipeError(
                f"packing: the {name} texts hold fewer than --seq-len={cfg.data.seq_len} tokens in all; "
                "lower --seq-len or add text"
            )
        if cfg.data.prompt_field:
            empty = [i for i, labels in enumerate(ds["labels"]) if all(t == -100 for t in labels[1:])]
            if empty:
                raise RecipeError(
                    f"{name} row {empty[0] + 1}: the prompt fills all --seq-len={cfg.data.seq_len} tokens, "
                    f"no response token is left to learn ({len(empty)} such row(s)); raise --seq-len or shorten the prompts"
                )


def collate(tokenizer: PreTrainedTokenizerBase, pad_to: int | None = None, *, packed: bool = False) -> Collate:
    """Pad a list of samples into a batch; labels are padded with -100 (ignored by the loss). Packed
    rows (--packing on) go through hf_memstack.data.PackedCollator: position_ids restarting at each
    sample and no attention_mask (a 2-D mask would let the samples attend to each other)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if packed:
        from hf_memstack.data import PackedCollator

        return PackedCollator(pad_token_id=pad_id, pad_to=pad_to)

    def fn(samples: list[Sample]) -> Batch:
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
