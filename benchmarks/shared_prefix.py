"""The trainer's step with and without shared prefixes (``trainer.share_prefix``), side by side.

Batches are real rollouts of the demo model: 8 prompts × G=8 of the demo task (prompts with the chat
template, 128 new tokens at most, T=1, scored by the ``math`` verifier), and the same responses behind
a longer prompt (the demo prompt after ``--long`` tokens of filler: an agent's system prompt and tool
schemas, or a long question). Each batch is trained for one step (token-mean PPO clip, lr 1e-4) from
the same weights, with the plain forward and with shared prefixes, alternating, ``--repeats`` times
each, at 1 thread (a trainer in the async modes on 2 cores) and at 2; the table gives the median step
time and the ratio. The two steps' weights agree to float rounding (checked here too).

    python benchmarks/shared_prefix.py               # ~3 minutes on 2 cores
    python benchmarks/shared_prefix.py --critic      # GAE: the policy's and the critic's step
    python benchmarks/shared_prefix.py --repeats 9 --long 400
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402

PROMPTS, G, MAX_NEW = 8, 8, 128


def rollouts(model, tok, seed: int, filler: list[int]):
    """8 groups of G responses to demo prompts (``filler`` tokens before each prompt), scored."""
    from relayrl.data.datasets import load_prompts
    from relayrl.engine.hf import HFEngine
    from relayrl.models.prompts import encode_prompt
    from relayrl.records import FinishReason, GenRequest, Group, SamplingParams, Trajectory
    from relayrl.rewards.verifiers import math_reward

    torch.manual_seed(seed)
    engine = HFEngine(copy.deepcopy(model), tok, driven=True)
    prompts = load_prompts("builtin:demo", limit=PROMPTS)
    ids = [filler + encode_prompt(tok, p.messages) for p in prompts]
    params = SamplingParams(MAX_NEW, 1.0)
    reqs = [GenRequest(f"g{i}/{j}", ids[i], params) for i in range(PROMPTS) for j in range(G)]
    done = engine.generate(reqs)
    engine.close()
    groups = []
    for i, p in enumerate(prompts):
        trajs = []
        for j in range(G):
            c = done[i * G + j]
            t = Trajectory(p, f"g{i}", j, ids[i], c.token_ids, c.logprobs, c.versions,
                           c.finish_reason or FinishReason.STOP)
            t.reward = math_reward(tok.decode(c.token_ids, skip_special_tokens=True), p.answer, {})
            trajs.append(t)
        groups.append(Group(p, f"g{i}", trajs))
    return groups


def step_seconds(model, batch, share: bool, threads: int, critic_path: str | None):
    """One step's seconds (with ``critic_path``: GAE, the critic's values and update included) and the
    policy it trained."""
    from relayrl.config import AlgoCfg, CriticCfg, TrainerCfg
    from relayrl.train.critic import Critic, load_value_model
    from relayrl.train.trainer import Trainer

    torch.set_num_threads(threads)
    m = copy.deepcopy(model)
    tcfg = TrainerCfg(share_prefix=share)
    critic = Critic(load_value_model(critic_path), CriticCfg(), tcfg, 10, torch.device("cpu")) if critic_path else None
    tr = Trainer(m, tcfg, AlgoCfg(kl_coef=0, advantage="gae" if critic else "grpo"), 1.0, 10, MAX_NEW, critic=critic)
    for s in (tr.sharing, *([critic.sharing] if critic else [])):
        s.verified = True  # (the one-time check is not the step's cost)
    torch.manual_seed(0)
    t = time.perf_counter()
    tr.step(batch)
    return time.perf_counter() - t, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:demo")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long", type=int, default=200, help="filler tokens before each prompt in the long-prompt rows")
    ap.add_argument("--critic", action="store_true", help="GAE with a critic (the critic's values and update "
                    "in the step; every row trains)")
    ap.add_argument("--name", default=None, help="results name (default: shared_prefix, shared_prefix_critic)")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    from relayrl.config import AlgoCfg
    from relayrl.models import load_policy, load_tokenizer, resolve_model_path
    from relayrl.rollout.groups import training_batch

    path = resolve_model_path(a.model)
    model, tok = load_policy(path), load_tokenizer(path)
    filler = tok("The quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)["input_ids"][: a.long]
    header = ["prompt", "threads", "rows trained", "tokens: prompt / response per row", "plain step s",
              "shared-prefix step s", "speed-up", "max weight difference"]
    rows, data = [], {"machine": machine_info(), "repeats": a.repeats, "cases": []}
    for label, pre in (("demo", []), (f"demo + {len(filler)} tokens", filler)):
        groups = rollouts(model, tok, 0, pre)
        batch, _ = training_batch(groups, AlgoCfg(kl_coef=0), MAX_NEW, tok.pad_token_id)
        moving = sum(len(g.trajectories) for g in groups if a.critic or len(set(g.rewards)) > 1)  # (GRPO: the
        # rest have advantage 0 and are not forwarded; GAE: every row has its values' advantages)
        lens = batch.attention_mask.sum(1).float()
        prompt_len = (batch.loss_mask.argmax(1) + 1).float()
        for threads in (1, 2):
            times = {False: [], True: []}
            weights = {}
            for _r in range(a.repeats):
                for share in (False, True):
                    s, m = step_seconds(model, batch, share, threads, path if a.critic else None)
                    times[share].append(s)
                    weights[share] = m
            pairs = zip(weights[False].parameters(), weights[True].parameters())
            diff = max((p - q).abs().max().item() for p, q in pairs)
            plain, shared = statistics.median(times[False]), statistics.median(times[True])
            rows.append([label, threads, f"{moving} of {batch.size}",
                         f"{prompt_len.mean():.0f} / {(lens - prompt_len).mean():.0f}", f"{plain:.3f}", f"{shared:.3f}",
                         f"{plain / shared:.2f}x", f"{diff:.1e}"])
            data["cases"].append({"prompt": label, "threads": threads, "plain": times[False], "shared": times[True],
                                  "max_weight_diff": diff})
            print(rows[-1], flush=True)
    write_results(Path(a.out), a.name or ("shared_prefix_critic" if a.critic else "shared_prefix"), header, rows,
                  data)


if __name__ == "__main__":
    main()
