"""PTQTP (arXiv 2509.16989): weights as sums of ternary planes with real scales.

decompose.py solves the planes, gguf_file.py writes them as TQ2_0 tensors (forgebench convert
--dtype ptqtp), weight.py serves a 2-plane file (forward = sum of the per-plane products),
imatrix.py collects the per-column activation mean squares an activation-aware fit weights by.
"""
