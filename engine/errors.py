"""User-facing errors: one clear message naming the file, the field and what to do."""

from __future__ import annotations


class ForgebenchError(Exception):
    """An error caused by the user's input or environment, reported without a traceback.

    `path` names the file or directory, `where` the line, record or field, `hint` what to do.
    """

    def __init__(self, message: str, *, path: object = None, where: str | None = None,
                 hint: str | None = None):
        self.message = message
        self.path = None if path is None else str(path)
        self.where = where
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        location = ""
        if self.path:
            location = self.path + (f": {self.where}" if self.where else "") + ": "
        elif self.where:
            location = f"{self.where}: "
        text = location + self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


def excerpt(value: object, limit: int = 80) -> str:
    """A bad value as an error message may quote it: its repr, cut to `limit` characters (a
    10 MB field must not flood the terminal)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
