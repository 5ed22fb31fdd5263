"""One error type for everything a user can get wrong.

The CLI prints an NlqError as a single line (no traceback unless --debug) and exits with
status 2, so every bad key, file or value is named and nothing else is printed.
"""


class NlqError(Exception):
    """A user-facing error: the message names the bad key, file or value and what to do."""
