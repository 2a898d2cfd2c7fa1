"""``relayrl sft``: supervised fine-tuning on demonstrations, on the pieces ``relayrl train`` runs on.

    take examples (seeded epochs) → the negative log-likelihood of the assistant's tokens → step → checkpoint

The same ``Trainer`` (packing on by default here, the chunked head, checkpointing, LoRA, bf16, FSDP2 under
torchrun), configuration, checkpoints (``relayrl train model.path=CKPT`` and ``relayrl eval --checkpoint
CKPT`` take them as they are), trackers, curves, model card and exact resume after ``kill -9`` (the data
cursor is the sampler's state, checkpointed with the weights). Held-out evaluation is ``relayrl train``'s:
the engine samples answers to data.eval_path's prompts and reward.fn scores them, before, every
eval.every steps and after.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time

import torch
from rich.console import Console

from relayrl.config import AlgoCfg, Config, dump_config, resolved_tree
from relayrl.data.datasets import PromptSampler, load_prompts
from relayrl.data.sft import Example, load_examples
from relayrl.engine.placement import cores, free_cores, open_engine, threads
from relayrl.engine.spec import engine_spec, eos_token_ids
from relayrl.models import ModelError, load_policy, resolve_model_path, vision
from relayrl.records import Trajectory
from relayrl.run import model_card
from relayrl.run.build import eval_settings, load_adapter, load_tokenizer_for, make_reward_runner, make_runner
from relayrl.run.checkpoint import CheckpointWriter, RunState, restore_rng
from relayrl.run.evaluation import evaluate, fmt_change, fmt_eval
from relayrl.run.resume import ResumeError, check_compatible, prepare_run_dir, start_state
from relayrl.run.stops import StopRequested, StopSignals
from relayrl.tracking import ProgressBar, RunReport, Timers
from relayrl.train import distributed, lora
from relayrl.train.batch import TrainBatch, build_batch
from relayrl.train.trainer import Trainer


def examples_fingerprint(examples: list[Example]) -> str:
    """sha256 of the examples' tokens and masks, in order: a resume must see the same data."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.id, e.prompt_ids, e.response_ids, e.mask]).encode())
    return h.hexdigest()[:16]


def sft_batch(examples: list[Example], pad_id: int) -> TrainBatch:
    """Right-padded rows of ``examples``, the loss mask on their supervised tokens."""
    trajs = [Trajectory(None, "", i, e.prompt_ids, e.response_ids, [0.0] * len(e.response_ids),
                        [0] * len(e.response_ids), mask=list(e.mask)) for i, e in enumerate(examples)]
    return build_batch(trajs, torch.zeros(len(trajs)), pad_id)


def sft_steps(cfg: Config, n_examples: int) -> int:
    """run.steps, or ⌈sft.epochs × examples / sft.batch_size⌉."""
    if cfg.sft.epochs is None:
        return cfg.run.steps
    return max(1, math.ceil(cfg.sft.epochs * n_examples / cfg.sft.batch_size))


def _examples(cfg: Config, tokenizer, log) -> list:
    d = cfg.data
    return load_examples(d.path, tokenizer, d.prompt_field, d.response_field, d.id_field, d.prompt_format,
                         cfg.model.system_prompt, d.min_reward, log)


def _steps(cfg: Config, base: str, log) -> int:
    """A follower rank's steps: rank 0's, resolved as rank 0 resolves them (with sft.epochs, from the examples:
    from run.steps, unresolved, its learning-rate schedule decayed at another pace than rank 0's)."""
    if cfg.sft.epochs is None:
        return cfg.run.steps
    return sft_steps(cfg, len(_examples(cfg, load_tokenizer_for(cfg, base, log)[0], log)))


def sft_trainer(cfg: Config, policy, steps: int) -> Trainer:
    """The trainer of a supervised run: log-probs of the plain softmax (temperature 1, no truncation), no
    KL reference, no sampling alarm."""
    return Trainer(policy, cfg.trainer, AlgoCfg(kl_coef=0.0), 1.0, steps, 1)


class Evaluator:
    """``relayrl train``'s held-out evaluation for a supervised run: an engine that gets the trainer's weights
    before each evaluation, episodes scored by reward.fn."""

    def __init__(self, cfg: Config, base: str, tok_path: str, tokenizer, prompts: list, first, lora_spec):
        self.cfg, self.tokenizer, self.prompts = cfg, tokenizer, prompts
        with contextlib.ExitStack() as undo:
            self.reward = make_reward_runner(cfg)
            undo.callback(self.reward.close)
            spec = engine_spec(cfg.rollout, cfg.model.dtype, base, tok_path, 0, cfg.run.seed,
                               threads(cfg.rollout, cfg.run)[1], lora_spec)
            self.engine = open_engine(spec, cfg.run, cfg.ray, first, tokenizer)
            undo.callback(self.engine.close)
            self.runner = make_runner(cfg, self.engine, tokenizer, self.reward, None, eos_token_ids(base, tokenizer))
            undo.pop_all()

    def __call__(self, weights: dict, version: int, when: str) -> dict:
        self.engine.load_weights(weights, version)
        return evaluate(self.runner, self.tokenizer, self.prompts, eval_settings(self.cfg), when)

    def close(self) -> None:
        self.runner.close()
        self.engine.close()
        self.reward.close()


def sft(cfg: Config, resume: bool = False, console: Console | None = None) -> dict:
    """A supervised run; returns its summary (the same keys as ``relayrl train``'s where they apply)."""
    distributed.check_launch(cfg.trainer, cfg.rollout.device)
    if distributed.is_follower(cfg.trainer):  # torchrun rank > 0: its share of rank 0's steps
        quiet = lambda *a, **k: None  # noqa: E731
        base = resolve_model_path(cfg.model.path, log=quiet)
        policy, _ = load_adapter(cfg, load_policy(base, cfg.model.dtype), None)
        return distributed.run_follower(sft_trainer(cfg, policy, _steps(cfg, base, quiet)))
    with StopSignals() as stop:  # SIGTERM, SIGUSR1: the step finished and saved, then StopRequested
        return _sft(cfg, resume, console or Console(soft_wrap=True), stop)


def _sft(cfg: Config, resume: bool, console: Console, stop: StopSignals) -> dict:
    log = console.print
    state, trainer_state, ckpt = start_state(cfg, resume, log)
    from relayrl.tracking import Trackers

    Trackers.check(cfg.run.report_to, cfg.run_dir)
    base = resolve_model_path(cfg.model.path, log=log)
    tokenizer, tok_path = load_tokenizer_for(cfg, base, log)
    if vision.processor_of(tokenizer) is not None:  # (its examples' image tokens would be trained without images)
        raise ModelError(f"model.path={cfg.model.path!r}: a vision-language model; relayrl sft does not take them yet "
                         "(relayrl train does: docs/guides/vision.md)")
    d = cfg.data
    examples = _examples(cfg, tokenizer, log)
    eval_prompts = load_prompts(d.eval_path, d.prompt_field, d.answer_field, d.id_field, d.metadata_fields,
                                cfg.model.system_prompt, limit=cfg.eval.size, prompt_format=d.prompt_format) \
        if d.eval_path else None
    fingerprint = examples_fingerprint(examples)
    cfg.run.steps = sft_steps(cfg, len(examples))
    if ckpt:
        check_compatible(state.config, cfg, state.data_fingerprint, fingerprint, ckpt)
    else:
        state.config, state.data_fingerprint = cfg.model_dump(mode="json"), fingerprint
    steps = cfg.run.steps  # (sft.epochs resolved above: the recorded config says the steps it trained)
    supervised = sum(e.supervised for e in examples)
    log(f"sft: {len(examples):,} examples ({supervised:,} supervised tokens of {sum(e.tokens for e in examples):,}), "
        f"{cfg.sft.batch_size} per step, {steps} steps" + (f" (sft.epochs={cfg.sft.epochs:g})" if cfg.sft.epochs else
                                                             f" ({steps * cfg.sft.batch_size / len(examples):.2f} epochs)"))
    adapter = cfg.model.lora.r > 0
    weights = str(ckpt) if ckpt and not adapter else base
    torch.manual_seed(cfg.run.seed)
    trainer_threads = cfg.run.threads or free_cores()  # (as relayrl train: a thread on a busy core slows every step)
    torch.set_num_threads(trainer_threads)
    log(f"threads: {trainer_threads}" + ("" if cfg.run.threads else
                                         f" ({cores()} cores, the free ones counted at start: run.threads sets them)"))
    policy = load_policy(weights, cfg.model.dtype, field="checkpoint" if ckpt and not adapter else "model.path")
    policy, lora_spec = load_adapter(cfg, policy, ckpt)
    trainer = sft_trainer(cfg, policy, steps)
    evaluator = None
    try:
        if eval_prompts:
            first = lora.adapter_state(policy) if adapter else policy.state_dict()
            evaluator = Evaluator(cfg, base, tok_path, tokenizer, eval_prompts, first, lora_spec)
        summary = _loop(cfg, state, trainer_state, ckpt, examples, steps, policy, tokenizer, trainer, evaluator,
                        lora_spec.adapter_config(base) if lora_spec else None, log, console, stop)
        trainer.close()
        return summary
    finally:
        if evaluator is not None:
            evaluator.close()


def _loop(cfg: Config, state: RunState, trainer_state, ckpt, examples, steps, policy, tokenizer, trainer, evaluator,
          adapter_config, log, console, stop: StopSignals) -> dict:
    run_dir = cfg.run_dir
    prepare_run_dir(run_dir, fresh=ckpt is None)
    dump_config(cfg, run_dir / "config.yaml")
    if ckpt:
        trainer.load_state_dict(trainer_state)
        restore_rng(trainer_state)
        log(f"resumed from {ckpt} (step {state.step}, {state.samples} examples)")

    def evaluate_now(when: str) -> dict:
        return evaluator(trainer.full_state_dict(), state.step, when)

    if state.eval_before is None and evaluator is not None:
        state.eval_before = evaluate_now("before training")
        log(f"eval before: {fmt_eval(state.eval_before)}")
    sampler = PromptSampler(examples, cfg.run.seed, cfg.data.shuffle, state.sampler)
    tree = resolved_tree(cfg)
    metrics = RunReport(cfg.run, run_dir, tree, state, log)
    writer = CheckpointWriter(run_dir, policy, tokenizer, cfg.run.keep_checkpoints, trainer.full_state_dict,
                              card=model_card.for_run(tree, kind="sft"), adapter=adapter_config)
    timers, t_start = Timers(), time.perf_counter() - state.wall_seconds
    stop.armed = True  # from here a stop signal finishes the step it comes in and saves it
    try:
        with ProgressBar(steps, state.step, cfg.run.progress, console, cfg.run.log_every_s) as bar:
            while state.step < steps:
                with timers("step"):
                    chosen = sampler.take(cfg.sft.batch_size)
                    batch = sft_batch(chosen, tokenizer.pad_token_id)
                    with timers("train"):
                        m = trainer.sft_step(batch)
                state.advance(batch.size, _NoStats, time.perf_counter() - t_start)
                times = timers.pop()
                tokens = int(batch.attention_mask.sum())
                s = sampler.state
                m = {"step": state.step, "samples": state.samples, "epoch": s.epoch + s.position / len(examples), **m,
                     "tokens": tokens, "tokens_per_s": tokens / max(times["time/step"], 1e-9), **times,
                     "step_time": times["time/step"], "wall_seconds": round(state.wall_seconds, 2)}
                if evaluator is not None and cfg.eval.every and state.step % cfg.eval.every == 0:
                    t0 = time.perf_counter()
                    m.update({f"eval/{k}": v for k, v in evaluate_now(f"at step {state.step}").items()})
                    m["time/eval"] = round(time.perf_counter() - t0, 4)
                metrics.write(m)
                bar.update(m)
                last = state.step == steps or stop.signum is not None
                if (cfg.run.save_every and state.step % cfg.run.save_every == 0) or last:
                    state.sampler = sampler.snapshot()
                    writer.save(state, trainer.state_dict())
                if last:
                    break
        writer.wait()
        if stop.signum is not None:
            raise StopRequested(stop.signum, state.step)
        after = evaluate_now("after training") if evaluator is not None else None
        summary = _summary(cfg, state, after)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        model_card.finalize(run_dir, tree, state, after, kind="sft")
        metrics.finish(summary, None)
        log(f"[bold]done[/bold]: {state.step} steps, {state.samples} examples, {state.wall_seconds:.0f}s")
        if state.eval_before and after:
            log(fmt_change(state.eval_before, after))
        log(f"run directory: {run_dir}")
        return summary
    finally:
        writer.wait()
        metrics.close()


class _NoStats:  # (RunState.advance reads a verifier's counts: a supervised step has none)
    failures = timeouts = 0


def _summary(cfg: Config, state: RunState, after: dict | None) -> dict:
    before = state.eval_before
    return {"command": "sft", "steps": state.step, "samples": state.samples,
            "wall_seconds": round(state.wall_seconds, 1),
            "eval_accuracy_before": before["accuracy"] if before else None,
            "eval_accuracy_after": after["accuracy"] if after else None,
            "eval_greedy_accuracy_before": before["accuracy_greedy"] if before else None,
            "eval_greedy_accuracy_after": after["accuracy_greedy"] if after else None,
            "eval_reward_mean_before": before.get("reward_mean") if before else None,
            "eval_reward_mean_after": after.get("reward_mean") if after else None,
            "eval_before": before, "eval_after": after}


