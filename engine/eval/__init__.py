"""Evaluation metrics and review aids for the image and audio recipes.

Everything here works on numpy arrays and never imports torch or Qt at module top level, so the
app can recompute a metric or read a contour file without the training stack.
"""
