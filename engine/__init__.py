"""Forgebench training engine.

Importable without torch: the app reads run directories, config schemas and datasets through
this package. Modules that need torch import it themselves.
"""

__version__ = "0.1.0"
