"""Autotuning (MetaSchedule) and the tuning records builds consult."""
from mhagen.tune.records import Database, Tuning, TuningWarning, user_database_path


def tune(layer, target="x86", **options):
    """Tune a layer's kernels; see mhagen.tune.search.tune."""
    from mhagen.tune.search import tune as _tune
    return _tune(layer, target, **options)


__all__ = ["Database", "Tuning", "TuningWarning", "tune", "user_database_path"]
