"""Prompts: datasets (files, folders, the built-in tasks), the seeded sampler, prompt selection."""
