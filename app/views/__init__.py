"""Thin Qt views over the view-models in app.viewmodels."""
