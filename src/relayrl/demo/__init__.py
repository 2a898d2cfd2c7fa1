"""The built-in demo: a long-tail verifiable task and a tiny model built offline."""
