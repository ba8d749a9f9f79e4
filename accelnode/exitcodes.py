"""Process exit codes shared by every ``accelnode`` subcommand.

They are part of the CLI contract (documented in ``accelnode --help``).
"""

OK = 0
FAILURE = 1  # the command ran and failed (runtime error, bad content, remote refused)
USAGE = 2  # bad flags or arguments (argparse uses 2 as well)
PREREQUISITE = 3  # something the command needs is missing: a device, a socket, a directory
UNAVAILABLE = 4  # a peer could not be reached in time (registry, API server, kubelet)
INTERRUPTED = 130  # stopped by SIGINT before finishing

HELP = """exit codes:
  0    success
  1    the command failed (the message says why)
  2    bad usage: unknown flag, missing or malformed argument
  3    a prerequisite is missing (device, directory, socket, permission)
  4    a peer was unreachable within the deadline (registry, API server, kubelet)
  130  interrupted"""


class CLIError(Exception):
    """An error the CLI reports as one line on stderr, exiting with ``code``."""

    def __init__(self, message: str, code: int = FAILURE):
        super().__init__(message)
        self.code = code
