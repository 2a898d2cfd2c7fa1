"""The model card every checkpoint carries: ``README.md`` in the checkpoint folder, in the Hugging Face
convention (YAML front matter, then Markdown), so a checkpoint pushed to a hub says how it was made:
base model, data, algorithm and pipeline settings, steps, held-out accuracy before and after
training, relayrl's version. The metadata is built with ``huggingface_hub.ModelCardData`` (its
``model-index`` holds the held-out results); the final checkpoint's card gets the accuracy after
training once the last evaluation is done (``finalize``)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

# sections of the resolved config shown in the card, with the fields worth a line of their own
ALGORITHM = ("algo", ("advantage", "loss", "agg", "clip_low", "clip_high", "dual_clip", "kl_coef", "entropy_coef",
                      "offpolicy"))
PIPELINE = [("run", ("mode", "backend", "seed")),
            ("data", ("selection",)),
            ("rollout", ("engine", "engines", "prompts_per_step", "group_size", "max_new_tokens", "temperature",
                         "top_p", "top_k", "partial", "max_staleness", "dynamic_sampling", "budget")),
            ("trainer", ("lr", "schedule", "warmup_steps", "updates_per_step", "grad_clip")),
            ("env", ("name", "max_turns"))]
SFT = [("sft", ("epochs", "batch_size")), ("data", ("response_field", "min_reward")),
       ("trainer", ("lr", "schedule", "warmup_steps", "micro_batch_tokens", "pack", "grad_clip"))]


def _hub_id(path: str | None) -> str | None:
    """``path`` when it reads as a hub id (``org/name``, not a local folder or a builtin), else None."""
    if not path or path.startswith(("builtin:", "/", ".", "~")) or os.path.exists(path):
        return None
    parts = path.split("/")
    return path if len(parts) == 2 and all(parts) and "." not in parts[1][-8:] else None


def render(config: dict, step: int, samples: int, before: dict | None, after: dict | None, final: bool = False,
           kind: str = "rl") -> str:
    """The card's text for a checkpoint at ``step`` of a run with the resolved ``config`` (section ->
    field -> value); ``before``/``after``: held-out evaluations (``evaluation.evaluate``), or None;
    ``final``: the run's last checkpoint (also before run.steps, when eval.stop_at stopped it); ``kind``: "rl"
    (``relayrl train``) or "sft" (``relayrl sft``)."""
    from huggingface_hub import EvalResult, ModelCardData

    from importlib.metadata import version

    __version__ = version("relayrl")

    run, model, data, algo = config["run"], config["model"], config["data"], config["algo"]
    evals = []
    for when, e in (("before training", before), ("after training", after)):
        if e and data.get("eval_path"):
            for key, how in (("accuracy", f"sampled, T={e.get('temperature')}"), ("accuracy_greedy", "greedy")):
                mean = key.replace("accuracy", "reward_mean")  # (beside it where rewards give partial credit)
                for metric, name in (("accuracy", f"held-out accuracy {when} ({how}; reward ≥ 1)"),
                                     ("mean_reward", f"held-out mean reward {when} ({how})")):
                    value = e[key] if metric == "accuracy" else e.get(mean)
                    if value is None or (metric == "mean_reward" and abs(value - e[key]) <= 1e-12):
                        continue
                    evals.append(EvalResult(task_type="text-generation", dataset_type=str(data["eval_path"]),
                                            dataset_name=str(data["eval_path"]), metric_type=metric,
                                            metric_value=round(value, 4),  # (not 0.33999999999999997)
                                            metric_name=name))
    adapter = (model.get("lora") or {}).get("r", 0)  # model.lora: the checkpoint is a PEFT adapter on model.path
    meta = ModelCardData(library_name="peft" if adapter else "transformers", base_model=_hub_id(model["path"]),
                         datasets=[d for d in (_hub_id(data["path"]),) if d] or None, model_name=run["name"],
                         tags=["relayrl", "reinforcement-learning", str(algo.get("advantage"))] if kind == "rl" else
                         ["relayrl", "sft"],
                         eval_results=evals or None)

    def pct(e: dict | None, key: str) -> str:
        return f"{e[key]:.1%}" if e and e.get(key) is not None else "—"

    done = final or step >= run["steps"]
    how = (f"A policy trained by reinforcement learning with relayrl {__version__}: {algo.get('advantage')} advantages, "
           f"{algo.get('loss')} loss, `run.mode={run['mode']}`." if kind == "rl" else
           f"A policy fine-tuned on demonstrations with relayrl {__version__} (`relayrl sft`: the negative "
           f"log-likelihood of the assistant's tokens).")
    lines = [
        f"# {run['name']}", "",
        f"{how} Checkpoint of step {step} of {run['steps']}{'' if done else ' (an intermediate checkpoint)'}, "
        f"after {samples:,} trained {'responses' if kind == 'rl' else 'examples'}.", "",
        "| | |", "|---|---|",
        f"| base model | `{model['path']}`{_base_note(model['path'], bool(adapter))} |",
        *([(f"| adapter | LoRA, rank {adapter}, alpha {model['lora']['alpha']} (PEFT's files here; `relayrl export "
            "CHECKPOINT --merge OUT` writes a merged model) |")] if adapter else []),
        f"| training data | `{data['path']}` (prompt field `{data['prompt_field']}`) |",
        f"| {'reward' if kind == 'rl' else 'held-out verifier'} | `{config['reward']['fn']}` |",
        f"| held-out data | `{data.get('eval_path')}` ({config.get('eval', {}).get('size', '—')} prompts) |",
        f"| held-out accuracy, sampled | {pct(before, 'accuracy')} before → {pct(after, 'accuracy')} after |",
        f"| held-out accuracy, greedy | {pct(before, 'accuracy_greedy')} before → "
        f"{pct(after, 'accuracy_greedy')} after |",
        "", "Accuracy is the mean reward of responses sampled at the training temperature (and of the greedy "
        "response) on the held-out prompts" + ("" if done else "; after: when the run finishes, on its last "
                                               "checkpoint") + ".", "",
        *(["## Algorithm", "", *_rows(config, [ALGORITHM]), "", "## Pipeline", "", *_rows(config, PIPELINE), ""]
          if kind == "rl" else ["## Fine-tuning", "", *_rows(config, SFT), ""]),
        "## Full configuration", "",
        f"The resolved configuration (`relayrl {'train' if kind == 'rl' else 'sft'} config.yaml` with it reruns the "
        "training):", "",
        "```yaml", yaml.safe_dump(config, sort_keys=False).rstrip(), "```", "",
    ]
    return f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(lines)


REBUILD = {"builtin:demo": "`relayrl build-demo-model OUT`", "builtin:agent-demo": "`python -m relayrl.demo.agent_model OUT`",
           "builtin:swe-demo": "`python -m relayrl.run.swe_demo OUT`"}


def _base_note(path: str, adapter: bool) -> str:
    """Where a base that is no hub id comes from (the card's base_model metadata names hub ids only), for a
    reader of a checkpoint copied elsewhere: an adapter is nothing without its base."""
    if path in REBUILD:
        return (f" (relayrl's own, rebuilt by {REBUILD[path]}" + ("; adapter_config.json names this installation's "
                "copy, and relayrl finds the base again from state.json where that path is gone)" if adapter else ")"))
    return " (a local folder: the adapter needs it beside the checkpoint)" if adapter and not _hub_id(path) else ""


def _rows(config: dict, sections) -> list[str]:
    rows = ["| setting | value |", "|---|---|"]
    for sec, keys in sections:
        rows += [f"| `{sec}.{k}` | `{config[sec][k]}` |" for k in keys if k in config.get(sec, {})]
    return rows


def for_run(config: dict, kind: str = "rl"):
    """The card of a checkpoint of this run, from its RunState (``CheckpointWriter``'s ``card``)."""
    return lambda state: render(config, state.step, state.samples, state.eval_before, None, kind=kind)


def finalize(run_dir: Path, config: dict, state, after: dict | None, kind: str = "rl") -> Path | None:
    """The last checkpoint's card again, now with the held-out accuracy after training (written
    beside, then renamed over the old one)."""
    folder = Path(run_dir) / "checkpoints" / f"step_{state.step:06d}"
    if not folder.is_dir():
        return None
    tmp = folder / ".README.md.tmp"
    tmp.write_text(render(config, state.step, state.samples, state.eval_before, after, final=True, kind=kind))
    tmp.replace(folder / "README.md")
    return folder / "README.md"
