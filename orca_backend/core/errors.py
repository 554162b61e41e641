"""Exception types raised by the engine for callers to catch."""


class OrcaError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(OrcaError, ValueError):
    """A request (prompt or sampling parameters) is malformed; the message names the field."""


class ConfigError(OrcaError, ValueError):
    """An engine option or a model folder is unusable; the message names the option."""


class RunnerDiedError(OrcaError, RuntimeError):
    """The model runner cannot take iterations any more (its process, or one of its
    tensor-parallel ranks, died, hung or raised); the message names it and how it ended.
    The engine ends the requests it held and starts a new runner."""
