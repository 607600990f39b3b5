"""One error hierarchy for hetnode; every error names what it is about (a key, a field, a peer)."""


class HetnodeError(Exception):
    """Base class of every error hetnode raises on purpose."""


class ConfigError(HetnodeError):
    """A run config is invalid. Carries the file and the dotted key at fault."""

    def __init__(self, path: str, key: str, message: str) -> None:
        self.path = path
        self.key = key
        self.message = message
        super().__init__(f"{path}: {key}: {message}")


class DataError(HetnodeError):
    """A data source is missing, empty or cannot be decoded."""


class DataConfigError(DataError):
    """The run config's data section names what the data does not have (a path, a text column): mended
    by editing the config, not by running again, so the CLI exits 2 for it, as for a ConfigError."""


class SetupMismatch(HetnodeError):
    """A start refused because its flags or config do not fit what the data dir holds (another run, nothing
    to `--resume`): nothing was changed, and a restart with the same command is refused again, so the CLI
    exits 2 for it, as for a bad flag."""


class CheckpointError(HetnodeError):
    """A checkpoint cannot be read or does not match the model it is loaded into."""


class RefusedAnswer(CheckpointError):
    """What a coordinator URL answered cannot be used (malformed, over a limit, not a checkpoint of its own
    config): asking again will not help. The CLI exits 2 for it, as for a bad flag; a plain CheckpointError
    from a URL (unreachable, too slow, 503 busy, cut short, no checkpoint yet) may pass and exits 1."""


class WireError(HetnodeError):
    """A message from the network failed validation. `field` names the part at fault."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


class UpdateRefused(HetnodeError):
    """A training update was refused before it changed anything: its gradients are not finite (or too
    large for the optimiser's arithmetic). Names the micro-batch; weights and optimiser are as they were."""


class Stopped(HetnodeError):
    """A stop signal arrived while the daemon was still starting."""
