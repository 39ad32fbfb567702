"""The one error type that reaches a user: bad input, named by file, field and fix.

The CLI turns an ``InputError`` into a one-line message and exit code 2; it never
shows a traceback for one.
"""

from __future__ import annotations

from pathlib import Path


class InputError(Exception):
    """Bad input from the user: a file, a field in it, what was wrong, what to do.

    ``str(err)`` is the one line the CLI prints, e.g.
    ``config.json: field 'n_routed_experts': expected a positive integer, got -1``.
    """

    def __init__(self, message: str, *, file: str | Path | None = None, field: str | None = None,
                 hint: str | None = None):
        self.file = str(file) if file is not None else None
        self.field = field
        self.message = message
        self.hint = hint
        super().__init__(self.line())

    def line(self) -> str:
        parts = []
        if self.file:
            parts.append(self.file)
        if self.field:
            parts.append(f"field '{self.field}'")
        head = ": ".join(parts)
        text = f"{head}: {self.message}" if head else self.message
        if self.hint:
            text += f" ({self.hint})"
        return text
