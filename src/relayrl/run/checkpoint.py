"""Run state and atomic checkpoints.

``runs/<name>/checkpoints/step_NNNNNN/`` holds the policy (``save_pretrained``, safetensors,
with the tokenizer: loadable by ``from_pretrained``; with ``model.lora`` the adapter in PEFT's files,
``adapter_config.json`` and ``adapter_model.safetensors``, on the base model.path), ``trainer.pt`` (optimiser, scheduler,
RNG: torch, Python, and CUDA's per device when CUDA is in use), ``state.json`` (step,
samples, data cursor, policy version) and the model card ``README.md`` (``model_card``). A checkpoint is written to a temporary folder
(``.tmp-step_N``), renamed into place, then ``latest`` is replaced atomically, so a kill at any
moment leaves the previous checkpoint intact. Every file is fsynced, then the folder, before
the rename, and the parent folder after it, so a power loss cannot leave a ``step_N`` folder
whose files were never written out. A ``step_N`` that already exists is first renamed aside
(``.old-step_N``), never deleted before its replacement is in place; old checkpoints beyond
``keep`` are renamed to ``.trash-step_N`` before they are deleted. ``latest_checkpoint`` counts an
aside copy whose ``step_N`` is missing (a crash between the two renames), and
``remove_incomplete`` puts it back, and deletes temporary and trash folders.

``CheckpointWriter`` writes in the background (DataStates-LLM's idea): the caller's thread only
takes an in-memory snapshot (tensors cloned, state serialised, RNG captured), and a writer
thread puts it on disk while training and generation go on. One write at a time; the next
``save`` (or ``close``) waits for the previous one and re-raises its failure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from relayrl.data.prompt_sampler import SamplerState
from relayrl.fault_injection import fault_point
from relayrl.files import share
from relayrl.models import vision


@dataclass
class RunState:
    step: int = 0
    samples: int = 0
    version: int = 0
    wall_seconds: float = 0.0
    sampler: SamplerState = field(default_factory=SamplerState)
    eval_before: dict | None = None
    reward_failures: int = 0
    reward_timeouts: int = 0
    partial_buffer: list = field(default_factory=list)  # groups not yet trained (group_to_dict), run on when resumed
    partial_resumed: int = 0  # cumulative groups continued from the buffer
    staleness: dict = field(default_factory=dict)  # the rollout's cumulative counts (turns continued)
    failed_generations: int = 0  # (older checkpoints; failures["engine"] counts these now)
    failures: dict = field(default_factory=dict)  # episodes left out, by kind (relayrl.failures), cumulative
    groups_made: int = 0  # groups created so far: their ids stay unique across resumes
    role_baselines: dict = field(default_factory=dict)  # algo.advantage=rae: each game and role's running baseline
    speculative: dict = field(default_factory=dict)  # rollout.speculative: the run's counts (drafted, accepted, ...)
    config: dict = field(default_factory=dict)  # the resolved config the run was started with
    data_fingerprint: str = ""  # of the training prompts: a resume must see the same data

    def advance(self, batch_size: int, reward_stats, wall_seconds: float) -> None:
        """One step done: the policy version moves with the step (one publish per step in sync mode)."""
        self.step += 1
        self.version += 1
        self.samples += batch_size
        self.reward_failures = reward_stats.failures
        self.reward_timeouts = reward_stats.timeouts
        self.wall_seconds = wall_seconds

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RunState":
        d = dict(d)
        d["sampler"] = SamplerState(**d["sampler"])
        return cls(**d)


TMP, OLD, TRASH = ".tmp-", ".old-", ".trash-"  # prefixes of a checkpoint being written, set aside, deleted


def _fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder: its entries, i.e. renames and new names in it). Folders
    cannot be opened on Windows, where this is skipped for them."""
    if path.is_dir() and os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder (the deepest first, ``root`` last)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for f in files:
            _fsync_path(Path(dirpath) / f)
        _fsync_path(Path(dirpath))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _discard(path: Path) -> None:
    """Delete checkpoint folder ``path``: first renamed to a ``.trash-`` name (one atomic step), so a
    kill in the middle of the deletion never leaves a half-deleted ``step_*`` folder."""
    trash = path.with_name(TRASH + path.name)
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def snapshot(state: RunState, model, trainer_state: dict, weights=None) -> dict:
    """Everything a checkpoint holds, copied in memory now (so training may go on while it is written).
    ``weights()`` gives the policy's whole weights (default: ``model.state_dict``)."""
    import copy

    return {
        "step": state.step,
        "state_json": json.dumps(state.to_json(), indent=1),
        "weights": {k: v.detach().clone() for k, v in (weights or model.state_dict)().items()},
        "trainer": copy.deepcopy(trainer_state),
        "rng": capture_rng(),
    }


def capture_rng() -> dict:
    """torch's, Python's and, where CUDA is in use in this process, every device's CUDA RNG state.
    (CUDA not yet initialised: nothing on it drew random numbers, and asking would initialise it.)"""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def write_snapshot(run_dir: Path, snap: dict, model, tokenizer, keep: int) -> Path:
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        ckpts.mkdir(parents=True, exist_ok=True)
        _fsync_path(ckpts.parent)
    name = f"step_{snap['step']:06d}"
    final, tmp, aside = ckpts / name, ckpts / (TMP + name), ckpts / (OLD + name)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if snap.get("adapter"):  # model.lora: the adapter, in PEFT's files (the base is the run's model.path)
        from relayrl.train.lora import write_adapter

        write_adapter(tmp, snap["weights"], snap["adapter"])
    else:
        model.save_pretrained(tmp, state_dict=snap["weights"], safe_serialization=True)
    vision.save_tokenizer(tokenizer, tmp)
    if snap.get("card"):
        (tmp / "README.md").write_text(snap["card"])
    torch.save({**snap["trainer"], "rng": snap["rng"]}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(snap["state_json"])
    share([tmp, *tmp.rglob("*")])  # (before the rename: the folder is readable from its first moment under its name)
    _fsync_tree(tmp)  # every file on disk, and the folder's entries, before it gets its name
    fault_point("checkpoint")
    if final.exists():  # (the same step again) set aside, not deleted: some step_N exists at every moment
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
        _fsync_path(ckpts)
    os.replace(tmp, final)
    _fsync_path(ckpts)  # the rename itself is durable
    if aside.exists():  # (only counted while step_N is missing)
        shutil.rmtree(aside)
    _write_atomic(ckpts / "latest", final.name)
    old = sorted(p for p in ckpts.glob("step_*") if p.is_dir())
    for p in old[:-keep]:
        _discard(p)
    return final


class CheckpointWriter:
    def __init__(self, run_dir: Path, model, tokenizer, keep: int, weights=None, card=None, adapter=None):
        """``weights()``: the policy's whole weights on the CPU (default ``model.state_dict``; a trainer
        on a GPU or sharded over ranks gives ``Trainer.full_state_dict``); ``card(state)``: the text of
        the checkpoint's model card (``model_card.for_run``; None: none); ``adapter``: with model.lora, the
        adapter's ``adapter_config.json`` (``weights()`` then gives the adapter's tensors, saved in PEFT's format)."""
        self.run_dir, self.model, self.tokenizer, self.keep = run_dir, model, tokenizer, keep
        self.weights, self.card, self.adapter = weights, card, adapter
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: RunState, trainer_state: dict) -> None:
        self.wait()
        snap = snapshot(state, self.model, trainer_state, self.weights)
        snap["card"] = self.card(state) if self.card else None
        snap["adapter"] = self.adapter
        self._thread = threading.Thread(target=self._write, args=(snap,), name="relayrl-checkpoint", daemon=True)
        self._thread.start()

    def _write(self, snap: dict) -> None:
        try:
            write_snapshot(self.run_dir, snap, self.model, self.tokenizer, self.keep)
        except BaseException as e:  # re-raised by the next save or close
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint under {self.run_dir} failed: {err!r}") from err


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint. A checkpoint folder only gets its ``step_*`` name by an
    atomic rename once every file is written (and fsynced), so any such folder is complete; an
    ``.old-step_N`` (a complete ``step_N`` set aside for its replacement) counts where ``step_N``
    is missing: a crash fell between the two renames. ``latest`` is a pointer for people and is
    not trusted here (a kill can fall between the rename and it). Reads only (``remove_incomplete``
    puts the aside copy back)."""
    ckpts = run_dir / "checkpoints"
    done = {p.name: p for p in ckpts.glob(OLD + "step_*") if (p / "state.json").exists()}
    done = {name.removeprefix(OLD): p for name, p in done.items()}
    done.update({p.name: p for p in ckpts.glob("step_*") if (p / "state.json").exists()})
    return done[max(done)] if done else None


def remove_incomplete(run_dir: Path) -> list[Path]:
    """Tidy up after a kill: delete half-written checkpoint folders (``.tmp-step_*``) and
    half-deleted ones (``.trash-*``); an ``.old-step_N`` goes back to ``step_N`` if that is missing
    (the kill fell between setting it aside and renaming its replacement in), else it is deleted.
    Returns the folders deleted."""
    ckpts = run_dir / "checkpoints"
    removed = []
    for p in sorted(ckpts.glob(OLD + "step_*")):
        final = ckpts / p.name.removeprefix(OLD)
        if not final.exists() and (p / "state.json").exists():
            os.replace(p, final)
            _fsync_path(ckpts)
        else:
            removed.append(p)
    removed += sorted(ckpts.glob(TMP + "*")) + sorted(ckpts.glob(TRASH + "*"))
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def recorded_config(ckpt: str | Path) -> tuple[dict | None, str]:
    """The resolved config a checkpoint's run was started with (``RunState.config``, in its
    state.json) and that file; (None, "") for a folder without one (a plain from_pretrained model)."""
    path = Path(ckpt) / "state.json"
    if not path.is_file():
        return None, ""
    try:
        config = json.loads(path.read_text()).get("config")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: cannot read the checkpoint's recorded config: {e}") from None
    return (config, str(path)) if config else (None, "")


def load_run_state(ckpt: Path) -> tuple[RunState, dict]:
    state = RunState.from_json(json.loads((ckpt / "state.json").read_text()))
    trainer_state = torch.load(ckpt / "trainer.pt", weights_only=False)
    return state, trainer_state


def restore_rng(trainer_state: dict) -> None:
    rng = trainer_state.get("rng")
    if rng:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        cuda = rng.get("cuda")  # absent: saved without CUDA in use, or by an older version
        if cuda and torch.cuda.is_available():  # (on a machine with fewer devices: those it has)
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


# what a checkpoint folder holds for others: the model (or adapter), its tokenizer and card; not the run's own state
HUB_FILES = ["*.safetensors", "config.json", "generation_config.json", "adapter_config.json", "tokenizer*",
             "special_tokens_map.json", "chat_template.jinja", "*.model", "vocab.*", "merges.txt", "README.md",
             "adapters/**", "preprocessor_config.json", "processor_config.json"]


def push_to_hub(checkpoint: str, repo_id: str, private: bool = False, revision: str | None = None) -> str:
    """Upload ``checkpoint``'s model files (``HUB_FILES``: not state.json, not the optimiser's trainer.pt) to the hub
    repository ``repo_id`` (made if missing), with ``huggingface_hub``'s own client: its token (``HF_TOKEN`` or
    ``hf auth login``) and endpoint (``HF_ENDPOINT``). Returns the commit's URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(checkpoint)
    if not any(folder.glob("*.safetensors")) and not (folder / "adapters").is_dir():
        raise ValueError(f"{checkpoint}: no model weights (*.safetensors) to push")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                                 allow_patterns=HUB_FILES, commit_message=f"relayrl: {folder.name} of {folder.parent.parent.name}")
    except Exception as e:  # an HTTP error, or a hub that cannot be reached (the client's own exceptions)
        if not (isinstance(e, (HfHubHTTPError, OSError)) or type(e).__module__.startswith(("httpx", "requests"))):
            raise
        raise ValueError(f"push {checkpoint} to {repo_id} ({api.endpoint}): {str(e).splitlines()[0] if str(e) else type(e).__name__} "
                         "(HF_TOKEN, or `hf auth login`, gives the token; HF_ENDPOINT another hub)") from None
    return info.commit_url
