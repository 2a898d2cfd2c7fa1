"""The folder of a run the command line leaves unnamed (``relayrl train`` and ``relayrl sft``).

A reader of the docs runs ``relayrl train``, then ``relayrl train run.mode=async``, then ``relayrl train
model.lora.r=8``: each is another experiment and expects a folder of its own, not to stop on the first
run's checkpoints. So where run.name is not set (in the YAML file or on the command line), the run is
named by its command: the config file's name (``my.yaml`` → ``my``), or the command's default (``demo``,
``sft``), then each override as ``key-value``: ``relayrl train run.mode=async`` writes
``runs/demo-run.mode-async``. The same command names the same folder, so ``--resume`` added to it finds
the run. Fields that say how long a run goes, how often it is saved and how it is watched (``run.steps``,
``eval.*``, ...) leave the name alone: they do not change what is trained, and a run may be continued
with others (``relayrl train run.steps=200 --resume`` extends ``runs/demo``). A run.name that is set is
the folder, exactly.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from relayrl.config import aliases

# what does not name a run: its length, checkpoints, records, progress, threads, trackers and evaluation
# (--resume may change every one of them)
NOT_NAMING = {"run.name", "run.output_dir", "run.steps", "run.save_every", "run.keep_checkpoints",
              "run.save_rollouts", "run.progress", "run.log_every_s", "run.threads", "run.report_to", "run.project"}
NOT_NAMING_SECTIONS = {"eval"}
MAX_NAME = 64  # characters: a folder name short enough to type and to read in a listing


def _plain(text: str) -> str:
    """``text`` with the characters that are awkward in a path or a shell's word (/ : , spaces quotes brackets
    ...) as _."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text.strip()).strip("_")


def _part(override: str) -> str | None:
    """``section.key=value`` as ``section.key-value``, or None for a field that does not name a run."""
    key, _, value = override.partition("=")
    key = aliases.TRL.get(key.strip(), key.strip())  # (TRL's learning_rate names the run as trainer.lr does)
    if key in NOT_NAMING or key.split(".")[0] in NOT_NAMING_SECTIONS:
        return None
    return f"{_plain(key)}-{_plain(value) or 'none'}"


def run_name(base: str, config: str | None, overrides: list[str], named: bool) -> str:
    """The run's folder name: ``base`` where run.name was set (``named``), else the config file's stem
    (or ``base``, the command's default, without one) followed by the overrides that name a run."""
    if named:
        return base
    stem = (_plain(Path(config).stem) or base) if config else base
    name = "-".join([stem, *(p for p in map(_part, overrides) if p)])
    if len(name) > MAX_NAME:  # cut, and kept apart from other long names by a digest of the whole
        name = name[:MAX_NAME - 9] + "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return name
