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


# ---------------------------------------------------------------- interrupts

_received: int | None = None


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived. A BaseException (not Exception, not KeyboardInterrupt) so that
    neither ``except Exception`` in a stage nor click's KeyboardInterrupt handling swallows it;
    the CLI prints one "interrupted" line and exits ``128 + signum`` (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by signal {signum}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _on_signal(signum, frame) -> None:
    global _received
    if _received is not None:
        return  # the first signal decides the exit code; a second one must not interrupt the unwinding
    _received = signum
    raise Interrupted(signum)


def install_interrupt_handlers() -> None:
    """Turn SIGINT and SIGTERM into ``Interrupted`` and remember that one arrived.

    The memory matters: an exception raised while Python runs a ``__del__`` (rich's ``Group``
    does work there) is printed and dropped, so the raise alone can be lost; ``check_interrupt``
    (called by every report write) and the CLI's exit path re-raise from the recorded signal.
    """
    import signal
    import sys

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    default_hook = sys.unraisablehook

    def quiet_interrupts(unraisable) -> None:
        # an Interrupted dropped inside __del__ is not lost (it is recorded above); do not print it
        if not isinstance(unraisable.exc_value, Interrupted):
            default_hook(unraisable)

    sys.unraisablehook = quiet_interrupts


def interrupt_received() -> int | None:
    """The signal number of the first SIGINT/SIGTERM this process received, or None."""
    return _received


def check_interrupt() -> None:
    """Raise ``Interrupted`` if a signal arrived earlier (even if its first raise was swallowed)."""
    if _received is not None:
        raise Interrupted(_received)
