"""Exception types raised by the engine for callers to catch."""


class OrcaError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(OrcaError, ValueError):
    """A request (prompt or sampling parameters) is malformed; the message names the field."""


class ConfigError(OrcaError, ValueError):
    """An engine option or a model folder is unusable; the message names the option."""
