"""Recipes: one readable training script per task, each with a schema in `<name>_config.py`.

A recipe module provides `data_manifest(config)`, `train(job)`, `evaluate(run, checkpoint,
split)` and the hooks its capabilities promise (`generate`, `sample`, `search`, `decide`,
`load_trained`, `base_model`: engine/recipe_registry.py: CAPABILITY_HOOKS); its row in
`engine.recipe_registry.SPECS` registers it. Language-model recipes hand their step to
engine/train/lm_loop.py.
"""
