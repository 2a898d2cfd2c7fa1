"""The trackers, each through its own library (``relayrl[<name>]`` installs it), offline by default.

What each does on ``--resume`` (``metrics.jsonl`` drops the lines a killed attempt wrote past the
checkpoint; each tracker follows as far as it allows):

- tensorboard: the same folder; TensorBoard's own ``purge_step`` hides the killed attempt's
  events past the checkpoint, so the read-back equals ``metrics.jsonl`` (as float32: scalar
  summaries hold float32).
- wandb: the same run id, ``resume="allow"`` (offline: a new ``offline-run-*`` folder of the same
  run; ``wandb sync`` them in order). W&B keeps one value per step, the first it was sent. Its
  service writes the file every 0.5 s and holds a step's row until the next step: a killed attempt's
  folder may lack its last steps (``metrics.jsonl`` has them; nothing can make W&B write sooner).
- mlflow: the same run id. MLflow cannot delete metric values: a step the killed attempt logged
  past the checkpoint has two values, the resumed one the later (its latest value is right).
- trackio: the run of the same name, ``resume="allow"``; like MLflow, a re-logged step has two rows.
  Each step is written when it is logged (trackio's thread would wait 0.5 s: a run killed before
  its first write is not found, and --resume would start a second run).
- swanlab: the same run id, ``resume="allow"`` (offline: a new run folder of the same id).

The rollout records (``run.save_rollouts``) go to each as a table per recorded step (``table``):
TensorBoard a markdown text summary ``rollouts``, W&B a ``wandb.Table`` ``rollouts``, MLflow
``log_table`` to the artifact ``rollouts/step_NNNNNN.json`` (its tables have no step), trackio a
``trackio.Table``. SwanLab has no table type (text, images, echarts): it gets none.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from relayrl.tracking.base import Tracker, TrackerContext, TrackerError, check_reachable, import_library, quietly


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table; cells on one line, ``|`` escaped."""
    def cell(v) -> str:
        return (f"{v:.4g}" if isinstance(v, float) else str(v)).replace("\\", "\\\\").replace("|", "\\|") \
            .replace("\r", " ").replace("\n", " ⏎ ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


def _plain(v):
    """A config value as a tracker parameter: numbers, strings and bools as they are, the rest as JSON."""
    return v if isinstance(v, (int, float, str, bool)) else json.dumps(v)


class TensorBoard(Tracker):
    name, package, outputs = "tensorboard", "torch.utils.tensorboard", ("tensorboard",)

    def __init__(self, ctx: TrackerContext):
        super().__init__(ctx)
        from torch.utils.tensorboard import SummaryWriter

        self.dir = ctx.run_dir / "tensorboard"
        resume = ctx.resume_step is not None
        self.w = SummaryWriter(str(self.dir), flush_secs=10, purge_step=ctx.resume_step + 1 if resume else None)
        if not resume:
            from torch.utils.tensorboard.summary import hparams

            params = {k: _plain(v) for k, v in ctx.params.items()}
            for s in hparams(params, dict.fromkeys(["reward_mean", "eval/accuracy"])):
                self.w.file_writer.add_summary(s)
            import yaml

            text = yaml.safe_dump(ctx.config, sort_keys=False)
            self.w.add_text("config", "".join(f"    {ln}\n" for ln in text.splitlines()))  # (markdown: a code block)

    def where(self) -> str:
        return f"{self.dir} (tensorboard --logdir {self.dir})"

    def identity(self) -> dict:
        return {"log_dir": str(self.dir)}

    def log(self, scalars: dict[str, float], step: int) -> None:
        # the scalar summary (simple_value, float32): what TensorBoard's readers take for a scalar
        # (EventAccumulator.Scalars); new_style writes tensors, which they list as tensors instead.
        # metrics.jsonl keeps the doubles
        for k, v in scalars.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()  # on disk with metrics.jsonl's line: a live view is current, a kill loses nothing

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.w.add_text(name, markdown_table(columns, rows), step)  # (TensorBoard's text plugin renders markdown)
        self.w.flush()

    def images(self, paths: dict[str, Path], step: int) -> None:
        import numpy as np
        from PIL import Image

        for k, p in paths.items():
            self.w.add_image(f"pictures/{k}", np.asarray(Image.open(p).convert("RGB")), step, dataformats="HWC")

    def close(self, ok: bool) -> None:
        self.w.close()


class WandB(Tracker):
    name, package, outputs = "wandb", "wandb", ("wandb",)

    @staticmethod
    def mode() -> str:
        return os.environ.get("WANDB_MODE") or "offline"

    @classmethod
    def check(cls, run_dir: Path) -> None:
        super().check(run_dir)
        if cls.mode() in ("online", "run"):
            import netrc

            url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
            host = url.split("://")[-1].split("/")[0].split(":")[0]
            try:
                keyed = bool(os.environ.get("WANDB_API_KEY")) or bool(netrc.netrc().authenticators(host))
            except (OSError, netrc.NetrcParseError):
                keyed = False
            if not keyed:
                raise TrackerError("run.report_to has wandb with WANDB_MODE=online, but no API key is set "
                                   "(WANDB_API_KEY, or `wandb login`); unset WANDB_MODE to log offline")
            check_reachable("wandb", url, f"WANDB_MODE=online ({url})")

    def __init__(self, ctx: TrackerContext):
        super().__init__(ctx)
        import wandb

        # W&B writes its run file every 15 s by default; a killed run would lose up to that much
        flush = {"x_transaction_log_flush_interval": 0.5} if "x_transaction_log_flush_interval" in \
            wandb.Settings.model_fields else {}
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False, disable_git=True,
                                  **flush)
        try:
            with quietly():
                self.run = wandb.init(project=ctx.project, name=ctx.run_name, id=ctx.saved.get("id"),
                                      dir=str(ctx.run_dir), config=ctx.config, mode=self.mode(), reinit="create_new",
                                      resume="allow" if ctx.resume_step is not None else None, settings=settings)
        except Exception as e:
            if "is in use" not in str(e) or not os.environ.get("WANDB_SERVICE"):
                raise
            raise TrackerError(f"--resume: W&B run {ctx.saved.get('id')} is still open in the wandb service this "
                               "process shares (WANDB_SERVICE), which kept the killed run's stream: unset "
                               "WANDB_SERVICE, or restart that service") from None

    def where(self) -> str:
        folder = Path(self.run.dir).parent
        return f"{self.mode()} run {self.run.id} in {folder}" + (
            f" (upload: wandb sync {folder.parent}/offline-run-*-{self.run.id})" if self.mode() == "offline" else "")

    def identity(self) -> dict:
        return {"id": self.run.id, "mode": self.mode()}

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def images(self, paths: dict[str, Path], step: int) -> None:
        import wandb

        self.run.log({f"pictures/{k}": wandb.Image(str(p)) for k, p in paths.items()}, step=step)

    def summary(self, scalars: dict[str, float], step: int) -> None:
        self.run.summary.update(scalars)

    def close(self, ok: bool) -> None:
        with quietly():
            self.run.finish(exit_code=0 if ok else 1)


class MLflow(Tracker):
    name, package, outputs = "mlflow", "mlflow", ("mlflow.db", "mlartifacts")

    @staticmethod
    def uri(run_dir: Path) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"

    @classmethod
    def check(cls, run_dir: Path) -> None:
        super().check(run_dir)
        uri = cls.uri(run_dir)
        if uri.startswith(("http://", "https://")):
            check_reachable("mlflow", uri, f"MLFLOW_TRACKING_URI={uri}")
        elif uri.startswith("sqlite:"):  # (mlflow-skinny's local store needs them)
            import_library("mlflow", "sqlalchemy")
            import_library("mlflow", "alembic")

    def __init__(self, ctx: TrackerContext):
        super().__init__(ctx)
        import logging

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # (its database set-up messages)
        self.tracking_uri = self.uri(ctx.run_dir)
        self.client = c = MlflowClient(tracking_uri=self.tracking_uri)
        exp = c.get_experiment_by_name(ctx.project)
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        self.experiment_id = exp.experiment_id if exp else c.create_experiment(
            ctx.project, artifact_location=(ctx.run_dir / "mlartifacts").resolve().as_uri() if local else None)
        saved = ctx.saved.get("run_id")
        if saved:
            try:
                c.get_run(saved)
            except Exception as e:
                raise TrackerError(f"--resume: MLflow run {saved} is not in {self.tracking_uri} ({e})") from None
            self.run_id = saved
            c.update_run(saved, status="RUNNING")
            c.set_tag(saved, f"relayrl.resumed_at_step_{ctx.resume_step}", "true")
            return
        self.run_id = c.create_run(self.experiment_id, run_name=ctx.run_name,
                                   tags={"relayrl.run_dir": str(ctx.run_dir.resolve())}).info.run_id
        params = [Param(k, str(_plain(v))[:6000]) for k, v in ctx.params.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            c.log_batch(self.run_id, params=params[i:i + 100])
        c.log_dict(self.run_id, ctx.config, "config.yaml")

    def where(self) -> str:
        return f"run {self.run_id} in experiment {self.ctx.project!r} at {self.tracking_uri}"

    def identity(self) -> dict:
        return {"tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id, "run_id": self.run_id}

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        # an artifact per step (MLflow's tables are artifacts: no step of their own, so the step is in the name)
        self.client.log_table(self.run_id, {c: [r[i] for r in rows] for i, c in enumerate(columns)},
                              f"{name}/step_{step:06d}.json")

    def images(self, paths: dict[str, Path], step: int) -> None:
        for p in paths.values():
            self.client.log_artifact(self.run_id, str(p), artifact_path="pictures")

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class Trackio(Tracker):
    name, package = "trackio", "trackio"

    @classmethod
    def check(cls, run_dir: Path) -> None:
        super().check(run_dir)
        if os.environ.get("TRACKIO_SPACE_ID"):
            check_reachable("trackio", "https://huggingface.co", f"TRACKIO_SPACE_ID={os.environ['TRACKIO_SPACE_ID']}")
        elif os.environ.get("TRACKIO_SERVER_URL"):
            check_reachable("trackio", os.environ["TRACKIO_SERVER_URL"], "TRACKIO_SERVER_URL is set")

    def __init__(self, ctx: TrackerContext):
        super().__init__(ctx)
        import trackio

        with quietly():
            self.run = trackio.init(project=ctx.project, name=ctx.run_name, config=ctx.config, embed=False,
                                    resume="allow" if ctx.resume_step is not None else "never",
                                    auto_log_cpu=False, auto_log_gpu=False)

    def where(self) -> str:
        from trackio.utils import TRACKIO_DIR

        return f"run {self.run.name} ({self.run.id}) of project {self.ctx.project!r} in {TRACKIO_DIR} " \
               f"(trackio show --project {self.ctx.project})"

    def identity(self) -> dict:
        from trackio.utils import TRACKIO_DIR

        return {"project": self.ctx.project, "name": self.run.name, "id": self.run.id, "dir": str(TRACKIO_DIR)}

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)
        self.persist()

    def persist(self) -> None:
        """Written now, as metrics.jsonl is. trackio's own thread writes every 0.5 s, and a run killed before
        its first write is not in the database: --resume would then start a second run, not continue this
        one. (trackio has no public flush; a version without this private one keeps its 0.5 s batches.)"""
        flush, lock = getattr(self.run, "_flush_queues_inline", None), getattr(self.run, "_client_lock", None)
        if flush is not None and lock is not None and getattr(self.run, "_is_local", False):
            with lock:
                flush()

    def table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        import trackio

        self.run.log({name: trackio.Table(columns=columns, data=rows)}, step=step)
        self.persist()

    def images(self, paths: dict[str, Path], step: int) -> None:
        import trackio

        self.run.log({f"pictures/{k}": trackio.Image(str(p)) for k, p in paths.items()}, step=step)

    def close(self, ok: bool) -> None:
        import trackio

        with quietly():
            try:
                trackio.finish()  # (ours is the current run; this also clears it, so exiting does not finish it again)
            except RuntimeError:
                self.run.finish()


class SwanLab(Tracker):
    name, package, outputs = "swanlab", "swanlab", ("swanlog",)

    @staticmethod
    def mode() -> str:
        return os.environ.get("SWANLAB_MODE") or "offline"

    @classmethod
    def check(cls, run_dir: Path) -> None:
        super().check(run_dir)
        if cls.mode() in ("online", "cloud"):
            host = os.environ.get("SWANLAB_API_HOST") or "https://api.swanlab.cn"
            check_reachable("swanlab", host, f"SWANLAB_MODE={cls.mode()} ({host})")

    def __init__(self, ctx: TrackerContext):
        super().__init__(ctx)
        import swanlab

        settings = swanlab.Settings(interactive=False, terminal={"proxy_type": "none"},
                                    probe={"monitor": False, "hardware": False, "git": False, "requirements": False})
        saved = ctx.saved.get("id") if ctx.resume_step is not None else None
        with quietly():
            self.run = swanlab.init(mode=self.mode(), log_dir=str(ctx.run_dir / "swanlog"), project=ctx.project,
                                    name=ctx.run_name, config=ctx.config, settings=settings, reinit=True,
                                    **({"id": saved, "resume": "allow"} if saved else {}))

    def where(self) -> str:
        return f"{self.mode()} run {self.run.id} in {self.ctx.run_dir / 'swanlog'}" + (
            f" (upload: swanlab sync {self.ctx.run_dir / 'swanlog'}/run-*-{self.run.id})"
            if self.mode() == "offline" else "")

    def identity(self) -> dict:
        return {"id": self.run.id, "mode": self.mode()}

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def images(self, paths: dict[str, Path], step: int) -> None:
        import swanlab

        self.run.log({f"pictures/{k}": swanlab.Image(str(p)) for k, p in paths.items()}, step=step)

    def close(self, ok: bool) -> None:
        with quietly():
            self.run.finish(state="success" if ok else "crashed", error=None if ok else "the relayrl run failed")


BACKENDS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoard, WandB, MLflow, Trackio, SwanLab)}
