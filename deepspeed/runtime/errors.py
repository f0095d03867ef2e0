"""Errors raised across the runtime's layers (kept at the bottom so any layer may import them)."""


class NotSupportedYet(NotImplementedError):
    """A config feature this implementation parses but does not run yet."""
