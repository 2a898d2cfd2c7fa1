"""A run: assembling the components (``build``), the training loop (``loop``), checkpoints, resume,
evaluation, the model card."""
