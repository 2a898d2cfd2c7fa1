"""Where the trainer and the engines run: ``trainer.device`` / ``rollout.device``."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str, field: str = "trainer.device") -> torch.device:
    """``trainer.device`` (or ``rollout.device``): 'auto' is CUDA when available, else the CPU. Under
    torchrun each rank takes the GPU of its LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{field}={name!r}, but CUDA is not available here (torch {torch.__version__}, "
                         f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU visible'}): use "
                         f"{field}=auto or cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
