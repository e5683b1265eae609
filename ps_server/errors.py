"""The parameter server's error hierarchy; ``service`` maps each class to one status code."""


class PsError(Exception):
    """Base of every error a shard reports to a client."""


class InvalidArgument(PsError):
    """The request is malformed: wrong shard, size, dtype or device count."""


class UnknownWorker(PsError):
    """A worker id this job does not have."""


class StepConflict(PsError):
    """A push for a step the shard is not at: stale (past) or ahead of the shard."""


class NotReady(PsError):
    """The shard has not received its initial parameters yet, or is shutting down."""


class WaitTimeout(PsError):
    """A pull waited for a version that did not appear before its deadline."""


class PayloadTimeout(PsError):
    """A push held a staging slot and its payload did not arrive within the job's push timeout."""
