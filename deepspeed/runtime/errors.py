"""Errors raised across the runtime's layers (kept at the bottom so any layer may import them)."""


class NotSupportedYet(NotImplementedError):
    """A config feature this implementation parses but does not run yet."""


class UsageError(RuntimeError, AssertionError):
    """Misuse that upstream rejects with an `assert`: user code, libraries and upstream's tests catch
    AssertionError there, so ours is one too, with a message that says what to do instead."""


class ArgumentError(ValueError, AssertionError):
    """A bad argument that upstream rejects with an `assert` (see UsageError)."""


class UnsupportedCombination(NotSupportedYet, AssertionError):
    """A combination of features this build refuses where upstream refuses it too with an `assert`
    (e.g. DeepSpeed's MoE layer under ZeRO-3): callers catching either kind see it."""
