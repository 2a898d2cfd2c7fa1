"""What each tracker wrote, read back with that tracker's own reader: TensorBoard's
``EventAccumulator``, ``wandb leet inspect`` (W&B's reader of its ``.wandb`` transaction log),
MLflow's client on the local store, trackio's ``SQLiteStorage``, SwanLab's ``DataStoreReader`` (the
one ``swanlab sync`` reads its offline files with). Each returns ``{key: {step: value}}``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def tensorboard(log_dir: Path) -> tuple[dict, dict]:
    """({tag: {step: value}}, the EventAccumulator) — the accumulator purges what ``purge_step`` hides.
    Scalars are TensorBoard's scalar summaries (float32), read as TensorBoard reads them: ``Scalars``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}, ea


def tensorboard_hparams(ea) -> dict:
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = ea.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in hparams.items()}


def wandb_records(run_file: Path) -> list[dict]:
    """Every record of a ``.wandb`` file, as ``wandb leet inspect --json`` prints them."""
    done = subprocess.run(["wandb", "leet", "inspect", "--json", str(run_file)], capture_output=True, text=True,
                          timeout=120, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def wandb_history(records: list[dict]) -> dict:
    out: dict = {}
    for r in records:
        if r["type"] == "history":
            step = r["history"]["step"]["num"]
            for k, v in r["history"]["item"].items():
                if not k.startswith("_"):
                    out.setdefault(k, {})[step] = v
    return out


def mlflow_run(tracking_uri: str, run_id: str) -> tuple[dict, dict, list[str], object]:
    """({key: {step: value}} — the latest value logged at each step —, params, artifact paths, the run)."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=tracking_uri)
    run = c.get_run(run_id)
    out = {}
    for key in run.data.metrics:
        hist = sorted(c.get_metric_history(run_id, key), key=lambda m: m.timestamp)
        out[key] = {m.step: m.value for m in hist}
    arts = [a.path for d in c.list_artifacts(run_id) for a in (c.list_artifacts(run_id, d.path) if d.is_dir else [d])]
    return out, run.data.params, arts, run


def mlflow_history(tracking_uri: str, run_id: str, key: str) -> list:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri).get_metric_history(run_id, key)


def trackio_logs(project: str, run_id: str) -> tuple[dict, list[dict]]:
    """({key: {step: value}} — the last row at each step —, the rows)."""
    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs(project, run_id=run_id)
    out: dict = {}
    for row in rows:
        for k, v in row.items():
            if k not in ("step", "timestamp"):
                out.setdefault(k, {})[row["step"]] = v
    return out, rows


def trackio_runs(project: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_records(project)


def trackio_config(project: str, name: str, run_id: str) -> dict:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_run_config(project, name, run_id=run_id)


def swanlab_records(run_folder: Path) -> list[dict]:
    from google.protobuf.json_format import MessageToDict
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (f,) = run_folder.glob("run-*.swanlab")
    reader = DataStoreReader()
    reader.open(f)
    out = []
    for data in reader:
        rec = Record()
        rec.ParseFromString(data)
        out.append(MessageToDict(rec, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))
    reader.close()
    return out


def swanlab_scalars(records: list[dict]) -> dict:
    out: dict = {}
    for r in records:
        if "scalar" in r:
            s = r["scalar"]
            out.setdefault(s["key"], {})[int(s["step"])] = s["value"]["number"]
    return out
