"""Serving models to other programs: the request schema every server entry point validates
with (`requests`: `forgebench serve-local`'s JSON lines and the OpenAI-compatible HTTP API),
the models a workspace can serve (`catalog`), the batched, cancellable generation scheduler
(`scheduler`), JSON-schema-constrained decoding (`constrained`) and the HTTP app (`http`).

Importing this package imports nothing heavy: torch, Starlette and uvicorn load only in the
modules that need them.
"""
