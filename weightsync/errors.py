"""Errors of the weight-sync library. All are ``ValueError`` subclasses: bad input, never a bug."""


class DeltaError(ValueError):
    """Base class: something about a delta, a state or a bucket object is wrong."""


class StateMismatchError(DeltaError):
    """The tensors given do not match what the delta describes (names, dtypes or shapes)."""


class BaseMismatchError(DeltaError):
    """The state the delta would be applied to is not its base version; nothing was written."""


class CorruptDeltaError(DeltaError):
    """A serialized delta or anchor is truncated, tampered with or not in the expected format."""


class VerificationError(DeltaError):
    """After apply, the result does not match the digest the trainer recorded.

    The state that was written to must be considered poisoned: reload an anchor.
    """


class ContextMismatchError(DeltaError):
    """A chained delta needs the context of a different delta than the one given (or none was
    given). Nothing was decoded or written: use the standalone delta of the same version."""
