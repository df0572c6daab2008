"""The exception types for bad input: the CLI prints them as a one-line error and exits non-zero.

They live in the lowest layer (analyzer) so that every package can raise them; nothing else here is shared.
"""


class UserError(Exception):
    """Bad input or a state the user can fix; the message names the problem and the fix."""


class CheckpointError(UserError):
    """A checkpoint that is bad in itself (unreadable weights, NaN features): it fails alone, and a run over many
    checkpoints goes on with the others."""
