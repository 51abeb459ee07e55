"""Serving models to other programs: the request schema every server entry point validates
with (`requests`: `forgebench serve-local`'s JSON lines and the OpenAI-compatible HTTP API),
the models a workspace can serve (`catalog`), the batched, cancellable generation scheduler
(`scheduler`), JSON-schema-constrained decoding (`constrained`) and the HTTP app (`http`).

Importing this package imports nothing heavy: torch, Starlette and uvicorn load only in the
modules that need them.
"""

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (the rule `forgebench serve`
    and the app's Serve switch apply before exposing models without a key)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
