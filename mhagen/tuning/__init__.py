"""Autotuning (MetaSchedule) and the tuning records builds consult."""
from mhagen.tuning.records import Database, Tuning, TuningWarning, user_database_path

__all__ = ["Database", "Tuning", "TuningWarning", "user_database_path"]
