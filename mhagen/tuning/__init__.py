"""Autotuning (MetaSchedule): the search that writes tuning records (search.py) on top of the
lowering and the schedules. The records builds consult are mhagen.records; their names stay
importable from here."""
from mhagen.records import Database, Tuning, TuningWarning, user_database_path

__all__ = ["Database", "Tuning", "TuningWarning", "user_database_path"]
