"""The whole RL loop on relayrl's public pieces, synchronous and in one process: the place to start
reading. ``relayrl train`` runs the same pieces with everything around them (modes that overlap
generation and training, partial rollouts, checkpoints, trackers): ``src/relayrl/run/loop.py``.

    python examples/minimal_loop.py [STEPS]     # GRPO on the built-in demo task, ~1 s a step on 2 cores
"""

import asyncio
import copy
import sys

import torch

from relayrl.config import AlgoCfg, TrainerCfg
from relayrl.data.datasets import load_prompts
from relayrl.engine.hf import HFEngine
from relayrl.models import load_policy, load_tokenizer, resolve_model_path
from relayrl.records import SamplingParams
from relayrl.rewards import RewardRunner
from relayrl.rollout.groups import drop_failed, make_groups, training_batch
from relayrl.rollout.runner import EpisodeRunner
from relayrl.train.trainer import Trainer

PROMPTS, GROUP, MAX_TOKENS = 16, 8, 96


def main(steps: int = 20, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    path = resolve_model_path("builtin:demo")  # a 1.8M-parameter Llama shipped with relayrl
    tokenizer = load_tokenizer(path, "chat")
    policy = load_policy(path)
    engine = HFEngine(copy.deepcopy(policy), tokenizer, eos_token_ids=[tokenizer.eos_token_id])  # its own copy
    prompts = load_prompts("builtin:demo")

    verifier = RewardRunner("math")  # reward.fn: isolated worker processes, a time limit per call

    def verify(items):  # [(text, prompt)] -> [(reward, failure)]: a failure is left out of training, never a 0
        return verifier.score([(text, p.answer, dict(p.metadata)) for text, p in items])

    runner = EpisodeRunner(engine, tokenizer, make_env=None, limits=None, score_batch=verify)
    algo = AlgoCfg(advantage="grpo", loss="ppo_clip", kl_coef=0.0)
    trainer = Trainer(policy, TrainerCfg(lr=1e-4), algo, temperature=1.0, total_steps=steps, norm_len=MAX_TOKENS)
    params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.0)
    rewards = []
    try:
        for step in range(steps):
            batch_prompts = prompts[step * PROMPTS % len(prompts):][:PROMPTS]
            groups = make_groups(batch_prompts, tokenizer, GROUP, tag=f"s{step}")

            async def rollout():  # every episode of every group at once, on the runner's event loop
                return await asyncio.gather(*(runner.group(g, params) for g in groups))

            runner.run(rollout())  # generate (the policy version each token came from rides along) and verify
            groups, _ = drop_failed(groups)  # (episodes whose verifier failed: counted by relayrl train)
            batch, _ = training_batch(groups, algo, MAX_TOKENS, tokenizer.pad_token_id)
            metrics = trainer.step(batch, version=step)  # π_old, group advantages, the clipped loss, AdamW
            engine.load_weights(trainer.full_state_dict(), step + 1)  # publish: the engine samples v + 1 now
            rewards.append(sum(t.reward for g in groups for t in g.trajectories) / sum(len(g.trajectories) for g in groups))
            print(f"step {step + 1}: reward {rewards[-1]:.3f}  loss {metrics['loss']:+.4f}  "
                  f"grad_norm {metrics['grad_norm']:.3f}")
    finally:
        runner.close()  # (closes the engine too)
        verifier.close()
    return rewards


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
