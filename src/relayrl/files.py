"""File modes of what relayrl writes for others to read: checkpoints, exported and demo models."""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask (Linux says it in /proc; elsewhere it is read by setting it, a moment in which
    a file another thread creates gets the usual 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share(paths) -> None:
    """``paths`` (files and folders) readable as any the user creates (0644 and 0755 under the usual umask
    022): safetensors writes its files 0600 (a private temporary file, renamed) and mkdtemp its folder 0700,
    where a checkpoint or a model is for other users and serving containers to read too."""
    mask = umask()
    for p in paths:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
