"""The one exception type for "the user asked for something impossible"."""


class KvbenchError(Exception):
    """Bad input or an impossible request. The CLI prints it as one line and exits 2.

    The message says what is wrong and how to fix it.
    """
