"""The project's own errors. The CLI turns each into a one-line message and a non-zero exit."""


class K3TuneError(Exception):
    """Base of every error a user can cause or fix; never a programming error."""

    exit_code = 1


class ConfigError(K3TuneError):
    """A model config, sweep spec or option value is malformed or out of range."""

    exit_code = 2


class HardwareError(K3TuneError):
    """Unknown hardware, or hardware needed but not present."""

    exit_code = 3


class DatabaseError(K3TuneError):
    """The tuning database cannot be opened, read or written. ``transient``: the server went away (a restart, a
    failover, a dropped connection), so the same transaction may succeed on a new connection."""

    exit_code = 4

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class SchemaError(DatabaseError):
    """The database schema is older or newer than this k3tune understands."""


class CannotImplement(K3TuneError):
    """A kernel family cannot implement a problem or config (kept apart from real failures)."""

    exit_code = 5


class WorkerError(K3TuneError):
    """A measurement worker could not be started (its backend failed to initialise)."""

    exit_code = 6
