"""Tools a model calls while it generates (engine/tools/calculator.py: nanochat's calculator)."""
