"""The one mark of a user's mistake: an entry point shows a :class:`Refusal` as one line and exits 2. Any
other exception is a bug and keeps its traceback (exit 1). At the lowest floor (corpus) so that every floor
above can raise one; the standard library only."""

import sys


class Refusal(Exception):
    """A user's mistake (a value, a path, a file, a run folder): its message is the one line shown, and says
    what to do instead."""


def refused(message: object) -> int:
    """``error: <message>`` on stderr and exit status 2, for ``return refused(err)``."""
    print(f"error: {message}", file=sys.stderr)
    return 2
