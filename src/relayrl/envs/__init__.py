"""Environments and tools for agent episodes."""
