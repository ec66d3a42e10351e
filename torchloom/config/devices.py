"""The device a command or an API call names, checked against this machine before any work."""

from __future__ import annotations

import re

import torch

from torchloom.config.errors import ConfigError, did_you_mean


def checked_device(value: str | torch.device, option: str) -> torch.device:
    """``value`` ('cpu', 'cuda', 'cuda:N' or such a torch.device) as a torch.device; ConfigError
    naming ``option`` (e.g. '--device', 'device=') for anything else, or a CUDA device this
    machine does not have."""
    name = str(value) if isinstance(value, torch.device | str) else None
    if name is None or not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ConfigError(
            f"{option} must be cpu, cuda or cuda:N; got {value!r}."
            f"{did_you_mean(name, ['cpu', 'cuda']) if name else ''}"
        )
    if name != "cpu" and not torch.cuda.is_available():
        raise ConfigError(
            f"{option} {name}: this machine has no CUDA device (torch.cuda.is_available() is "
            f"False); use {option} cpu."
        )
    device = torch.device(name)
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"{option} {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}."
        )
    return device
