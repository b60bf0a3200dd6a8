"""Tuning records per x86 CPU class: the closest caches win, machines with the same
caches keep their own, a preset run here looks up this CPU's, a record of another
class is never applied."""

import mhagen
from mhagen.target import resolve
from mhagen.records.database import Database


def _record(kernel, cpu_class, l2, q_tile, cpu=None):
    key = {"cpu_class": cpu_class, "l2_kib": l2, "l1d_kib": 32, "cpu": cpu, "dtype": "float32",
           "batch": 1, "seq": 64, "d_model": 64, "heads": 4, "kv_heads": 4, "head_dim": 16,
           "mask": "none", "graph": "g", "kernel": kernel}
    return {"key": key, "kind": "config", "config": {"q_tile": q_tile}}


def test_records_are_per_class_and_the_closest_caches_win():
    db = Database(records=[_record("attention", "x86_64-v256-r16", 512, 16),
                           _record("attention", "x86_64-v256-r16", 2048, 32),
                           _record("attention", "x86_64-v512-r32", 1024, 64)])
    want = dict(_record("attention", "x86_64-v256-r16", 1536, 0)["key"])
    assert db.lookup(want)["config"]["q_tile"] == 32          # L2 2 MiB is closer to 1.5
    want["l2_kib"] = 640
    assert db.lookup(want)["config"]["q_tile"] == 16
    want["cpu_class"] = "x86_64-v128-r16"                      # no record of that class
    assert db.lookup(want) is None


def test_machines_with_the_same_caches_keep_their_own_records(tmp_path):
    """A Zen 4 and a Skylake-SP (L1d 32 KiB, L2 1 MiB both) each keep their record of a
    workload (tuning on one used to replace the other's); a lookup takes the same CPU's
    among equal caches, the closest caches before that, and any CPU's when none matches."""
    db = Database(tmp_path / "db.json")
    for cpu, q_tile in (("skylake-avx512", 32), ("znver4", 64), (None, 16)):
        db.put(_record("attention", "x86_64-v512-r32", 1024, q_tile, cpu))
    db.put(_record("attention", "x86_64-v512-r32", 512, 8, "znver3"))
    db.save()
    db = Database.load(tmp_path / "db.json")
    assert len(db.records) == 4
    want = dict(_record("attention", "x86_64-v512-r32", 1024, 0)["key"])
    for cpu, q_tile in (("znver4", 64), ("skylake-avx512", 32), (None, 16)):
        want["cpu"] = cpu
        assert db.lookup(want)["config"]["q_tile"] == q_tile, cpu
    want["cpu"] = "znver3"       # its own record has a 512 KiB L2: a 1 MiB one wins
    assert db.lookup(want)["config"]["q_tile"] in (16, 32, 64)
    want["l2_kib"] = 512
    assert db.lookup(want)["config"]["q_tile"] == 8


def test_a_preset_run_here_looks_for_this_cpus_records():
    """x86-avx2 compiles for `haswell`, but built on this machine it runs here: its records
    are looked up (and tuned) as this CPU's; a foreign architecture keeps its own CPU."""
    avx2 = resolve("x86-avx2")
    assert avx2.cpu == "haswell"
    assert avx2.machine_cpu == (resolve("x86").cpu if avx2.runs_here() else "haswell")
    assert resolve("x86").machine_cpu == resolve("x86").cpu
    assert resolve("arm-neon").machine_cpu == resolve("arm-neon").cpu
    layer = mhagen.mha(64, 4)
    key = mhagen.build(layer, "x86-avx2", batch=1, seq_len=8, tuning=None).program.key("qkv_projection")
    assert key["cpu"] == avx2.machine_cpu


def test_a_record_of_another_class_is_never_applied(tmp_path):
    layer = mhagen.mha(64, 4)
    avx512_key = mhagen.build(layer, "x86-avx512", batch=1, seq_len=64,
                              tuning=None).program.key("attention")
    rec = {"key": avx512_key, "kind": "config",
           "config": {"q_tile": 32, "kv_block": 64, "tile_rows": 4, "tile_cols": 32,
                      "out_rows": 4, "out_cols": 16}}
    Database(tmp_path / "db.json", [rec]).save()
    on_avx2 = mhagen.build(layer, "x86-avx2", batch=1, seq_len=64, tuning=tmp_path / "db.json")
    assert {d["kernel"]: d["source"] for d in on_avx2.decisions}["attention"] == "default"
    on_avx512 = mhagen.build(layer, "x86-avx512", batch=1, seq_len=64,
                             tuning=tmp_path / "db.json")
    assert {d["kernel"]: d["source"] for d in on_avx512.decisions}["attention"] == "tuned"
    assert on_avx512.tuning_records[0]["key"]["cpu_class"] == "x86_64-v512-r32"
