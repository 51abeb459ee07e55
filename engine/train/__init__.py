"""Training components shared by every recipe: checkpoints, optimizer steps, metrics, data order.

Recipes import these pieces and read top to bottom; there is no trainer class.
"""
