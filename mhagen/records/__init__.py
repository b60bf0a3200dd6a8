"""Tuning records: data that lowering and scheduling read, below the tuning search.

  database.py  the records (JSON, no TVM): Database, Tuning (what one build consults),
               workload_key, TuningWarning, where the user's database lives
  replay.py    a record's MetaSchedule trace replayed on a kernel, and the checks that it
               still fits (TVM side)

mhagen.tuning (the search that writes records, `mhagen tune`) imports this package; this
package imports nothing of the search, the lowering or the schedules.
"""
from mhagen.records.database import Database, Tuning, TuningWarning, user_database_path

__all__ = ["Database", "Tuning", "TuningWarning", "user_database_path"]
