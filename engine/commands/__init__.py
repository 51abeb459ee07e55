"""The `forgebench` subcommand handlers (`cmd_*(args) -> exit code`), one module per family.

engine/cli.py maps each subcommand to its handler by name and imports it only when it runs.
These modules are the only place argparse namespaces are read; the library below takes plain
arguments. See docs/architecture.md.
"""
