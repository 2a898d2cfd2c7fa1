"""Where a step's trajectories come from: episodes on the engine (``runner``, ``episode``), the
driver of every ``run.mode`` (``driver``), groups and the training batch (``groups``), bounded
staleness and length-aware scheduling."""
