"""CommandError: an expected failure of a `vllm-triforce` subcommand.

Its own module so that `cli.py` (which catches it) and the subcommands it loads
(`bench/cli.py`, which raise it) both import it without importing each other.
"""


class CommandError(Exception):
    """An expected failure of a subcommand: printed without a traceback, exit code 2."""
