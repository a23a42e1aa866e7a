"""The two kinds of failure the program distinguishes.

UserError: the user can fix it (config, layout, environment id, launch variables). It is printed as one line and
the process exits with code 2, before any rank has started waiting on another.

CommError: a wait between ranks failed or expired. The message names this rank and role, the peer, the operation
and the message; the process exits non-zero so the launcher takes the rest of the job down.
"""

USER_ERROR_EXIT_CODE = 2
COMM_ERROR_EXIT_CODE = 3


class UserError(Exception):
    """Bad input: printed without a traceback, exit code 2."""


class CommError(RuntimeError):
    """A point-to-point or collective wait that failed or timed out."""
