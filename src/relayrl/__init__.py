"""relayrl: reinforcement-learning post-training of language models where the rollout never stalls."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``relayrl.Run`` (``relayrl.run.api``), imported when first used: ``import relayrl`` stays light."""
    if name == "Run":
        from relayrl.run.api import Run

        return Run
    raise AttributeError(f"module 'relayrl' has no attribute {name!r}")
