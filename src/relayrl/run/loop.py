"""The training loop, the same for every mode:

    take a batch of groups (source) → reward → advantages → update → publish (v + 1) → checkpoint
"""

from __future__ import annotations

import json
import time

import torch
from rich.console import Console

from relayrl import failures
from relayrl.config import Config, dump_config, resolved_tree
from relayrl.engine import EngineError
from relayrl.engine.base import PolicyMismatch
from relayrl.engine.placement import engine_counters, spec_metrics
from relayrl.engine.speculative import run_summary
from relayrl.records import Group, group_to_dict
from relayrl.rollout.filter_watch import FilterWatch
from relayrl.rollout.groups import flatten, versions_behind
from relayrl.rollout.groups import drop_failed, training_batch
from relayrl.run import model_card
from relayrl.run.build import Components, build, follower_trainer, load_data, make_rollout, response_budget
from relayrl.run.checkpoint import CheckpointWriter, RunState, restore_rng
from relayrl.run.evaluation import episode_stats, fmt_change, fmt_eval, no_evaluation_note
from relayrl.run.stops import StopRequested, StopSignals
from relayrl.run.resume import (ResumeError, check_compatible, data_fingerprint, prepare_run_dir, restore_drafts,
                                start_state)
from relayrl.tracking import MetricsLog, ProgressBar, RunReport, Timers, Trackers
from relayrl.tracking.rollouts import RolloutLog
from relayrl.tracking.timeline import Timeline
from relayrl.train import distributed

__all__ = ["ResumeError", "train"]


def step_metrics(groups: list[Group], generated: int, step_seconds: float, state: RunState) -> dict:
    trajs = [t for g in groups for t in g.trajectories]
    rewards = torch.tensor([t.reward for t in trajs])
    lens = [len(t.response_ids) for t in trajs]
    trained_at = state.version - 1  # called after the step advanced the version
    stale = [versions_behind(g, trained_at) for g in groups]
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item() if len(trajs) > 1 else 0.0,
        "responses_per_group": len(trajs) / len(groups),
        "response_len_mean": sum(lens) / len(lens),
        "response_len_max": max(lens),
        "generated_tokens": generated,
        "tokens_per_s": generated / max(step_seconds, 1e-9),  # over the whole step
        "truncated_frac": sum(t.finish_reason.value == "length" for t in trajs) / len(trajs),
        "reward_failures_total": state.reward_failures + state.reward_timeouts,
        "offpolicy_token_frac": sum(v < trained_at for t in trajs for v in t.versions) / max(1, sum(lens)),
        "staleness_max": max(stale),
        "staleness_mean": sum(stale) / len(stale),
        "staleness_hist": [stale.count(k) for k in range(max(stale) + 1)],  # groups by versions behind
        **(episode_stats(trajs) if any(t.info for t in trajs) else {}),
    }


def train(cfg: Config, resume: bool = False, console: Console | None = None) -> dict:
    """The loop, the same for every mode (``run.mode`` decides how the rollout overlaps training:
    ``episode_rollout``).
    Returns the run summary."""
    distributed.check_launch(cfg.trainer, cfg.rollout.device)  # a device this machine lacks; torchrun without fsdp
    if distributed.is_follower(cfg.trainer):  # torchrun rank > 0: trains its share of rank 0's batches
        return distributed.run_follower(follower_trainer(cfg))
    with StopSignals() as stop:  # SIGTERM, SIGUSR1: the step finished and saved, then StopRequested
        return _run(cfg, resume, console or Console(soft_wrap=True), stop)


def _run(cfg: Config, resume: bool, console: Console, stop: StopSignals) -> dict:
    log = console.print  # (soft_wrap: a long line left to the terminal, not broken mid-sentence)
    entered = time.perf_counter()
    # everything that can be wrong with the input is found before the run directory is touched
    state, trainer_state, ckpt = start_state(cfg, resume, log)
    Trackers.check(cfg.run.report_to, cfg.run_dir)  # a tracker's library missing, its server unreachable
    data = load_data(cfg)
    fingerprint = data_fingerprint(data[0])
    if ckpt:
        check_compatible(state.config, cfg, state.data_fingerprint, fingerprint, ckpt)
    else:
        state.config, state.data_fingerprint = cfg.model_dump(mode="json"), fingerprint
    c = build(cfg, state, ckpt, data, log)
    try:
        summary = _train(cfg, c, state, trainer_state, ckpt, log, console, entered, stop)
        c.trainer.close()  # (trainer.fsdp: the other ranks stop)
        return summary
    finally:
        c.close()


def _train(cfg: Config, c: Components, state: RunState, trainer_state, ckpt, log, console, entered: float,
           stop: StopSignals) -> dict:
    run_dir = cfg.run_dir
    prepare_run_dir(run_dir, fresh=ckpt is None)
    r = cfg.rollout
    watch = FilterWatch(r.prompts_per_step, r.dynamic_sampling_max) if r.dynamic_sampling else None
    dump_config(cfg, run_dir / "config.yaml")
    if ckpt:
        c.trainer.load_state_dict(trainer_state)
        restore_rng(trainer_state)
        log(f"resumed from {ckpt} (step {state.step}, {state.samples} samples)")
        restore_drafts(cfg, c.engine, state.step, log)  # (rollout.speculative: earlier responses as drafts)
    evaluating = time.perf_counter()
    if state.eval_before is None and c.eval_prompts:
        state.eval_before = c.evaluate(cfg, "before training")
        log(f"eval before: {fmt_eval(state.eval_before)}")
    elif not c.eval_prompts and not state.step:
        log(no_evaluation_note(cfg.data))
    metrics = RunReport(cfg.run, run_dir, resolved_tree(cfg), state, log)  # metrics.jsonl, the trackers of run.report_to, curves.png
    trained_log = MetricsLog(run_dir / "trained_prompts.jsonl", resume_step=state.step)
    rollouts = RolloutLog(run_dir, cfg.run.save_rollouts, state.step, c.tokenizer)  # rollouts/step_N.jsonl.gz
    timers, t_start, tl = Timers(), time.perf_counter() - state.wall_seconds, Timeline()
    startup = evaluating - entered  # loading, engines, workers (not the evaluation before training)
    writer = CheckpointWriter(run_dir, c.policy, c.tokenizer, cfg.run.keep_checkpoints, c.trainer.full_state_dict,
                              card=model_card.for_run(resolved_tree(cfg)), adapter=c.adapter_config)
    source = make_rollout(cfg, c, state, tl)
    if source.eta + source.slack:
        log(f"staleness bound: {source.eta + source.slack} policy versions (η={source.eta}"
            + (f" + ⌈{source.extra}/{source.batch}⌉ for the over-provisioned groups" if source.slack else "") + ")")
    stop.armed = True  # from here a stop signal finishes the step it comes in and saves it
    try:
        with ProgressBar(cfg.run.steps, state.step, cfg.run.progress, console, cfg.run.log_every_s) as bar:
            while state.step < cfg.run.steps:
                step_start = tl.now()
                with timers("step"):
                    with timers("generate"):  # all of it when synchronous; what training did not hide otherwise
                        groups, generated = source.next_batch()
                    batch_groups = groups  # (with the failed episodes: the rollout records have them)
                    groups, failed = take_failures(groups, state, cfg)  # (episodes scored themselves, off this thread)
                    batch, shaping = training_batch(groups, cfg.algo, response_budget(cfg), c.tokenizer.pad_token_id,
                                                     state.role_baselines, c.trainer.adapters)
                    with timers("train"), tl.busy("trainer"), c.engine.asleep():  # (rollout.vllm_sleep)
                        train_metrics = {**c.trainer.step(batch, version=state.version), **shaping}
                    with timers("publish"):
                        source.publish(lambda: c.engine.load_weights(c.trainer.full_state_dict(), state.version + 1))
                state.advance(batch.size, c.reward.stats, time.perf_counter() - t_start)
                c.runner.mark_engine()  # (records the engine's busy period so far)
                span = max(tl.now() - step_start, 1e-9)
                idle = {f"{ln}_idle_frac": 1 - tl.busy_between(ln, step_start, step_start + span) / span
                        for ln in ("engine", "trainer")}
                filtered, dynamic = source.take_filtered()
                if watch and (note := watch.update(len(filtered))):
                    log(f"[yellow]{note}", highlight=False)
                if rollouts.due(state.step):
                    metrics.table(state.step, rollouts.write(state.step, batch_groups, groups, source.last_filtered,
                                                             trained_at=state.version - 1))
                m = record_step(cfg, c, state, groups, generated, {**train_metrics, **idle, **source.metrics(), **dynamic,
                                **c.sampler.metrics(), **engine_counters(c.engine),
                                **spec_metrics(c.engine, cfg.rollout.speculative == "on", state.speculative),
                                **failures.metrics(failed, state.failures),
                                **(c.runner.scoring.take_times() if c.runner.scoring else {})},
                                timers.pop(), metrics, source)
                trained_log.write({"step": state.step, "prompt_ids": [g.prompt.id for g in groups],
                                   **({"filtered_prompt_ids": filtered} if filtered else {})})
                check_sampling(m, cfg.run.mismatch_alarm, state.version - 1)  # (its metrics written, no checkpoint)
                bar.update(m)
                last = state.step == cfg.run.steps or reached(cfg, m, log) or stop.signum is not None
                if (cfg.run.save_every and state.step % cfg.run.save_every == 0) or last:
                    state.partial_buffer = [group_to_dict(g) for g in source.held()]  # generation stops here...
                    state.staleness, state.sampler = source.checkpoint_state()
                    writer.save(state, c.trainer.state_dict())  # ...while an in-memory copy is taken
                    source.release()
                if last:
                    break
        source.close()
        writer.wait()
        if stop.signum is not None:
            raise StopRequested(stop.signum, state.step)
        log(f"timeline: {(timeline := tl.save(run_dir))}")
        summary = finish(cfg, c, state, log, startup)
        metrics.finish(summary, timeline)  # curves.png; the pictures and the summary to the trackers
        return summary
    except (failures.UserCodeError, EngineError) as e:  # a stop signal sent to every process of the job may
        if stop.signum is None:  # have ended a tool's, a verifier's or an engine's process mid-step: the
            raise  # step is not trained and the run stops as asked (a resume runs that step again)
        raise StopRequested(stop.signum, state.step) from e
    finally:
        source.close()
        writer.wait()
        metrics.close()
        trained_log.close()


def take_failures(groups: list[Group], state: RunState, cfg: Config) -> tuple[list[Group], dict]:
    """The batch without its failed episodes, and their counts by kind (``relayrl.failures``); the run
    stops (``UserCodeError``) when more than run.max_failure_frac of them failed in user code."""
    where = f"step {state.step + 1}"
    counts = failures.check(flatten(groups), cfg.run.max_failure_frac, where)
    failures.check_tools(flatten(groups), cfg.run.max_failure_frac, where)
    kept, _ = drop_failed(groups)
    for k, n in counts.items():
        state.failures[k] = state.failures.get(k, 0) + n
    if not kept:
        if not counts:  # (nothing failed: a match's role that never moved has nothing to train)
            raise ValueError(f"{where}: nothing to train: in every match of the batch the roles the policy plays "
                             "never moved (the other side ended the game first); give it more matches per step "
                             "(rollout.prompts_per_step) or roles that move")
        if set(counts) == {"engine"}:
            raise EngineError(f"{where}: the engine failed on every response of the batch")
        raise failures.UserCodeError(f"{where}: every episode of the batch failed ({dict(counts)}); first: "
                                     f"{next(t.failure for t in flatten(groups) if t.failure)}")
    return kept, counts


def check_sampling(m: dict, alarm: float, version: int) -> None:
    """``run.mismatch_alarm``: the run stops when the engine is not sampling the trained policy, seen in the
    engine's log-probs of the tokens it sampled (``Trainer.step``'s metrics), against the trainer's under the
    weights of the version that sampled them: (a) more than ``alarm`` apart per token on average; or (b) on
    the rows checked against the previous version's weights too, further from this version's than twice
    the previous one's, and by more than ``alarm / 10``: the engine samples weights older than it says."""
    mean, check, prev = (m.get(k) for k in ("logprob_mismatch_mean", "logprob_mismatch_check",
                                              "logprob_mismatch_check_prev_weights"))
    if not alarm:
        return
    if mean is not None and mean > alarm:
        seen = (f"the {m['logprob_mismatch_tokens']:,} tokens checked have log-probs {mean:.3g} apart per token on "
                f"average (largest {m['logprob_mismatch_max']:.3g}) between the engine and the trainer, over "
                f"run.mismatch_alarm={alarm:g}")
    elif check is not None and check > max(2 * prev, alarm / 10):
        seen = (f"its tokens are {check:.3g} apart per token from the trainer's log-probs under version {version}'s "
                f"weights but {prev:.3g} under version {version - 1}'s: the engine samples older weights than it says "
                f"(run.mismatch_alarm={alarm:g})")
    else:
        return
    raise PolicyMismatch(
        f"the engine is not sampling the trained policy: at step {m['step']} (policy version {version}), {seen}. "
        "The engine's weights are not the trained ones: a weight update (or a LoRA adapter) that did not apply, or "
        "the engine samples otherwise than the trainer reads it (rollout.temperature/top_p/top_k); metrics.jsonl "
        "has the step")


def record_step(cfg: Config, c: Components, state: RunState, groups, generated: int, train_metrics: dict,
                times: dict, metrics: MetricsLog, source) -> dict:
    m = {"step": state.step, "samples": state.samples, **step_metrics(groups, generated, times["time/step"], state),
         **train_metrics, **times, "step_time": times["time/step"], "wall_seconds": round(state.wall_seconds, 2)}
    if cfg.eval.every and state.step % cfg.eval.every == 0 and c.eval_prompts:
        t0 = time.perf_counter()
        source.held()  # the rollout stops using the engine while it evaluates
        try:
            m.update({f"eval/{k}": v for k, v in c.evaluate(cfg, f"at step {state.step}").items()})
        finally:
            source.release()
        m["time/eval"] = round(time.perf_counter() - t0, 4)  # (in the next steps' wall_seconds)
    metrics.write(m)
    return m


def reached(cfg: Config, m: dict, log) -> bool:
    """``eval.stop_at``: this step's evaluation reached the target accuracy."""
    if cfg.eval.stop_at is None or m.get("eval/accuracy") is None or m["eval/accuracy"] < cfg.eval.stop_at:
        return False
    log(f"eval.stop_at: held-out accuracy {m['eval/accuracy']:.1%} ≥ {cfg.eval.stop_at:.1%} at step {m['step']}: "
        "training stops here")
    return True


def finish(cfg: Config, c: Components, state: RunState, log, startup: float | None = None) -> dict:
    after = c.evaluate(cfg, "after training") if c.eval_prompts else None
    before = state.eval_before
    summary = {
        "steps": state.step,
        "samples": state.samples,
        "wall_seconds": round(state.wall_seconds, 1),
        "startup_seconds": None if startup is None else round(startup, 2),  # this attempt's, to its first step
        "eval_accuracy_before": before["accuracy"] if before else None,
        "eval_accuracy_after": after["accuracy"] if after else None,
        "eval_greedy_accuracy_before": before["accuracy_greedy"] if before else None,
        "eval_greedy_accuracy_after": after["accuracy_greedy"] if after else None,
        "eval_reward_mean_before": before.get("reward_mean") if before else None,
        "eval_reward_mean_after": after.get("reward_mean") if after else None,
        "eval_before": before,
        "eval_after": after,
        "reward_failures": state.reward_failures,
        "reward_timeouts": state.reward_timeouts,
        "reward_errors": c.reward.stats.errors[:5],
        "episodes_left_out": dict(state.failures),  # by kind: failed, never trained (relayrl.failures)
        "episode_errors": c.runner.errors,
    }
    if c.agents:
        summary.update({f"eval_{k}_{when}": e.get(k) if e else None for k in ("tool_call_rate", "tool_call_rate_greedy")
                        for when, e in (("before", before), ("after", after))})
    if "win_rate" in (after or before or {}):  # a multi-agent environment: against its scripted player
        summary.update({f"eval_{k}_{when}": e.get(k) if e else None for k in ("win_rate", "win_rate_greedy")
                        for when, e in (("before", before), ("after", after))})
    if spec := run_summary(state.speculative):  # (rollout.speculative=on)
        summary["speculative"] = spec[0]
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    model_card.finalize(cfg.run_dir, resolved_tree(cfg), state, after)  # the last checkpoint's card: accuracy after
    log(f"[bold]done[/bold]: {state.step} steps, {state.samples} samples, {state.wall_seconds:.0f}s")
    if spec:
        log(spec[1])
    if before and after and "win_rate" not in after:
        log(fmt_change(before, after))
    if before and after and "win_rate" in after:
        opponent = cfg.env.args.get("opponent")  # (a checkpoint or a pool plays the other roles: say which)
        who = f"env.args.opponent={opponent}" if opponent else "the scripted player"
        log(f"win rate against {who}: {before['win_rate']:.1%} → {after['win_rate']:.1%} (greedy "
            f"{before['win_rate_greedy']:.1%} → {after['win_rate_greedy']:.1%})")
    elif c.agents and before and after and any(e.get(k) for e in (before, after) for k in (  # (an environment
            "tool_call_rate", "tool_call_rate_greedy", "tool_errors", "tool_timeouts")):  # without tools: no line)
        log(f"tool-call rate: {before['tool_call_rate']:.1%} → {after['tool_call_rate']:.1%} (greedy "
            f"{before['tool_call_rate_greedy']:.1%} → {after['tool_call_rate_greedy']:.1%}), tool errors "
            f"{after['tool_errors']} and timeouts {after['tool_timeouts']} in the last evaluation")
    if state.failures:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(state.failures.items()))
        n = sum(state.failures.values())
        log(f"[yellow]{n} episode{'s' if n != 1 else ''} failed and {'were' if n != 1 else 'was'} left out of "
            f"training ({kinds}); "
            f"first: {c.runner.errors[0] if c.runner.errors else c.reward.stats.last_error}")
    log(f"run directory: {cfg.run_dir}")
    return summary

