"""relayrl: reinforcement-learning post-training of language models where the rollout never stalls."""

__version__ = "0.1.0"
