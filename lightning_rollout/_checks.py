"""Argument checks shared by the public constructors (every message says what to pass instead), and
:func:`warn_user`, which points a warning about the user's arguments at the user's own line."""

from __future__ import annotations

import math
import sys
import threading
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["check_device", "check_int", "check_seconds", "warn_user"]

# Lightning's frames are skipped too: it calls ours from Trainer.fit
_INTERNAL_PACKAGES = frozenset({"lightning_rollout", "lightning", "pytorch_lightning", "lightning_fabric"})


def warn_user(message: str | Warning, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside this package and Lightning
    (their ``ThreadedCollector(...)``, or their ``trainer.fit(...)``); the outermost frame where all are internal."""
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _INTERNAL_PACKAGES:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def check_seconds(name: str, value: Any, *, allow_zero: bool) -> float | None:
    """``value`` as a float number of seconds, or ``None`` for ``None`` (no limit).

    A finite real number (numpy scalars included, bools not), ``> 0`` (``>= 0`` with ``allow_zero``) and at most
    :data:`threading.TIMEOUT_MAX`, which a ``Condition.wait`` takes without ``OverflowError``; else ``ValueError``.
    """
    if value is None:
        return None
    seconds = float(value) if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)) else math.nan
    low_ok = seconds >= 0 if allow_zero else seconds > 0
    if not (math.isfinite(seconds) and low_ok and seconds <= threading.TIMEOUT_MAX):
        low = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {low} and at most {threading.TIMEOUT_MAX:.0f}, "
                         f"or None for no limit; got {value!r}")
    return seconds


def check_device(name: str, device: Any) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays ``None``); ``ValueError``: not a device, or a CUDA / MPS
    device that is not available here (a CPU build of torch, no GPU, an index past the GPUs present)."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name} must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU build of torch" if torch.version.cuda is None else "no GPU visible"
            raise ValueError(f"{name}={str(resolved)!r} but CUDA is not available ({build}, torch "
                             f"{torch.__version__}); pass 'cpu', or run on a machine with a GPU and a CUDA build")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(f"{name}={str(resolved)!r} but only {count} CUDA device(s) are visible "
                             f"(cuda:0 .. cuda:{count - 1})")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{name}={str(resolved)!r} but MPS is not available on this machine; pass 'cpu'")
    return resolved


def check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    """An int (numpy ints included, bools not) ``>= minimum`` (or ``None`` when ``optional``), else ``ValueError``."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
