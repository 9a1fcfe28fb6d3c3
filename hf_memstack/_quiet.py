"""Drop the log lines that optional backends print on import and that are only noise.

Importing torchao (Transformers and PEFT import it when it is installed), or bitsandbytes on a CPU
with AVX512-BF16, logs lines that say nothing about the user's run:

- torchao: ``Failed to load .../torchao/_C_mxfp8...so`` and ``.../_C_cutlass_90a...so``: kernels
  built for other GPUs (MX formats on Blackwell, CUTLASS on sm90a) that no memstack policy uses;
- torch's pytree: ``<enum 'KernelPreference'> is an Enum subclass ... register_constant() ...
  deprecated``, once per torchao enum (torchao's call, torchao's deprecation to fix);
- bitsandbytes: ``Failed to load CPU gemm_4bit_forward from kernels-community``: it falls back to
  its own CPU kernel (the optional ``kernels`` package is a speed-up, not a requirement).

:func:`quiet_imports` drops exactly those records, matched by logger and message, while our code
imports or first uses those libraries; every other record of those loggers (a failing ``_C.so`` that
torchao's own ops need, another deprecation) still goes through, and outside the block nothing is
filtered.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import re
import threading
import warnings
from collections.abc import Callable, Iterator

# torchao's kernels for hardware and formats memstack does not use (see the module docstring).
_TORCHAO_OPTIONAL_KERNEL = re.compile(r"^Failed to load \S*torchao[/\\]_C_(mxfp8|cutlass_\w+)[.\w-]*\.so\b")
_PYTREE_ENUM = "is an Enum subclass and is now natively supported by torch.compile"
_BNB_KERNELS_HUB = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _torchao_optional_kernel(record: logging.LogRecord) -> bool:
    return bool(_TORCHAO_OPTIONAL_KERNEL.match(record.getMessage()))


def _torchao_enum_constant(record: logging.LogRecord) -> bool:
    # Only torchao's enums: the same deprecation for another library's call is left to show.
    args = record.args if isinstance(record.args, tuple) else ()
    cls = args[0] if args else None
    return (
        _PYTREE_ENUM in str(record.msg)
        and isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and cls.__module__.split(".")[0] == "torchao"
    )


def _bnb_kernels_hub(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith(_BNB_KERNELS_HUB)


_NOISE = {
    "torchao": _torchao_optional_kernel,
    "torch.utils._pytree": _torchao_enum_constant,
    "bitsandbytes.backends.cpu.ops": _bnb_kernels_hub,
}


class _DropNoise(logging.Filter):
    def __init__(self, is_noise: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self._is_noise = is_noise

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._is_noise(record)


_FILTERS = {name: _DropNoise(test) for name, test in _NOISE.items()}
_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, drop the import-time noise named in the module docstring (re-entrant)."""
    global _depth
    with _lock:
        if _depth == 0:
            for name, drop in _FILTERS.items():
                logging.getLogger(name).addFilter(drop)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, drop in _FILTERS.items():
                    logging.getLogger(name).removeFilter(drop)


@contextlib.contextmanager
def quiet_peft_wrap() -> Iterator[None]:
    """Around a ``get_peft_model`` call of ours (the estimator's, on a model it built): drop the
    ``is_gradient_checkpointing is deprecated`` FutureWarning that PEFT's own call into Transformers
    raises. It is PEFT's to fix and names nothing the user wrote; every other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"`is_gradient_checkpointing` is deprecated",
            category=FutureWarning,
            module=r"transformers\.modeling_utils",
        )
        yield
