"""The coordinator's error hierarchy; ``service`` maps each class to one status code."""


class CoordinatorError(Exception):
    """Base of every error the coordinator reports."""


class ConfigError(CoordinatorError, ValueError):
    """A job file key that is missing, unknown, mistyped or out of range."""


class InvalidRequest(CoordinatorError):
    """A request whose fields make no sense for this job (ids out of range, wrong devices)."""


class UnknownMember(CoordinatorError):
    """A worker or PS shard id that never registered, or a data shard it was never given."""


class WrongState(CoordinatorError):
    """The job is not in a state where this request can be served."""


class ProbeFailed(WrongState):
    """The master's probe still overflowed the device after the allowed rounds; the job fails."""


class AlreadyRegistered(CoordinatorError):
    """A PS shard id taken by another live process."""


class NoFreeSlot(CoordinatorError):
    """Every worker slot of the job is taken."""
