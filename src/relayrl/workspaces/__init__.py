"""Per-episode workspaces for coding and terminal agents: a task's repository at its commit, writable, in a
fail-closed sandbox (``sandbox``); tasks in SWE-bench's instance format (``tasks``); rewards from the tests,
run on the policy's patch in a fresh workspace (``grading``)."""
