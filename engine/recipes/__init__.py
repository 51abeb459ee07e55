"""Recipes: one readable training script per task, each with a schema in `<name>_config.py`.

A recipe module provides `data_manifest(config)`, `train(job)`, `evaluate(run, checkpoint,
split)` and optionally `generate(...)` / `sample(...)`; `engine.config.RECIPES` registers it.
"""
