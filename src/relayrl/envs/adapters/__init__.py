"""Environments users already have, each one line of config (README, "Any agent program, and the
environments you have"):

    data.path=reasoning_gym:NAME?size=N&seed=S   reward.fn=reasoning_gym    reasoning-gym's tasks and scorers
    env.name=textarena:GAME-v0                   (data.path=textarena:GAME-v0?size=N&seed=S)   TextArena games
    env.name=skyrl:NAME                          skyrl-gym environments (init / step / close)

Each needs its package (an optional extra of relayrl); without it the run stops at start naming the
extra to install. verifiers' training client (``verifiers.v1.clients.train.TrainClient``) speaks the
endpoint's token route (``relayrl.serve``: ``POST /inference/v1/generate``); verifiers v1
environments themselves do not run here (README: what did not run, and why).
"""

from __future__ import annotations



def rows(path: str) -> list[dict] | None:
    """The dataset rows of ``data.path=<prefix>:...`` for an adapter's prefix; None for other paths."""
    prefix = path.partition(":")[0]
    if prefix == "reasoning_gym":
        from relayrl.envs.adapters.reasoning_gym import rows as reasoning_gym_rows

        return reasoning_gym_rows(path)
    if prefix == "textarena":
        from relayrl.envs.adapters.textarena import rows as textarena_rows

        return textarena_rows(path)
    return None
