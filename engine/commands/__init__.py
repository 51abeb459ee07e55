"""CLI handlers (`cmd_*`), one module per command family; engine/cli.py maps names to them.

argparse namespaces stop here: handlers read the flags and call library functions.
"""
