"""The format layer's checkpoint errors (a module of their own: the loaders and the model-directory reader
both raise them)."""


class CheckpointError(ValueError):
    """A checkpoint whose config or tensors are inconsistent or unreadable; the message names the file/key at
    fault. (Defined here, the lowest layer that reads checkpoints; vkmoe.models re-exports it.)"""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the config requires is not in the checkpoint."""

    def __str__(self):  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""
