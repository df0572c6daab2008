"""The one exception type for bad input: the CLI prints it as a one-line error and exits non-zero."""


class UserError(Exception):
    """Bad input or a state the user can fix; the message names the problem and the fix."""
