"""The errors mhagen raises: each message says what is wrong and how to fix it."""


class MhagenError(Exception):
    """Base class of mhagen's errors."""


class GraphError(MhagenError, ValueError):
    """A graph or layer option is invalid (shapes, kinds, names, options)."""


class InputError(MhagenError, ValueError):
    """Arrays passed to a kernel or the reference have the wrong shape, dtype or names."""


class TargetError(MhagenError, ValueError):
    """An unknown target preset, or a target this machine cannot build for or run."""


class ScheduleError(MhagenError, RuntimeError):
    """A scheduled kernel cannot run on its target (e.g. GPU code left outside GPU threads), or
    its device code does not compile within the target's limits."""


class ArtifactError(MhagenError, ValueError):
    """A saved module is missing files, corrupted, or from an incompatible version."""
