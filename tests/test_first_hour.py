"""What a new user meets in the first hour: settings that would do nothing refused at load,
``relayrl eval --checkpoint`` evaluating what the run trained on, a verifier's wrong return value
named, Ctrl-C, and the messages and pictures around them."""

from __future__ import annotations

import pytest

from relayrl.cli import main
from relayrl.config import ConfigError, load_config


# ---------------------------------------------------------------- group_size=1 with a group baseline


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_one_response_per_group_is_refused_with_a_group_baseline(advantage, capsys):
    with pytest.raises(ConfigError, match=rf"rollout.group_size=1 with algo.advantage='{advantage}'.*"
                                          r"rollout.group_size ≥ 2.*reinforce_pp"):
        load_config(None, ["rollout.group_size=1", f"algo.advantage={advantage}"])
    assert main(["train", "rollout.group_size=1", f"algo.advantage={advantage}"]) == 2
    assert capsys.readouterr().err.startswith("relayrl: config error: ")
    # baselines that need no group still take one response a prompt
    for other in ("reinforce_pp", "gae"):
        assert load_config(None, ["rollout.group_size=1", f"algo.advantage={other}"]).rollout.group_size == 1
