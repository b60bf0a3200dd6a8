"""Tuning keeps its word (issue 60): the time budget is a limit for the whole run and says
what it stopped; the progress lines report the table's numbers; off a terminal one line per
update, no carriage returns; the closing message says how to resume."""
import io
import time

import pytest

import mhagen
from mhagen import tune
from mhagen.schedules.tvmscript import import_tensor_intrinsics
from mhagen.tuning.search import KernelResult, TuneReport, _Budget, _Progress


def test_a_tiny_time_budget_stops_the_whole_run_within_it_and_says_so(tmp_path, capsys):
    # done once per process, and never cut by the deadline (a module cut halfway cannot be
    # imported again): its 5-25 s here are not what this bounds
    import_tensor_intrinsics()
    started = time.monotonic()
    report = tune(mhagen.mha(64, 2), shapes=[(1, 16)], trials=4, time_budget=5,
                  database=tmp_path / "db.json", work_dir=tmp_path / "ms")
    elapsed = time.monotonic() - started
    assert elapsed < 5 + 20, f"a 5 s budget ran {elapsed:.0f} s"
    err = capsys.readouterr().err
    assert report.interrupted and report.stopped_by == "the time budget"
    assert report.budget_note.startswith("time budget of 5 s: ") and report.budget_note in err
    # every kernel without a record is named: with 5 s, at least the last two
    assert {"attention 1x16", "output_projection 1x16"} <= set(report.untuned)
    assert len(report.results) + len(report.untuned) == 3
    summary = report.summary()
    assert summary.startswith("stopped by the time budget: kept what was measured, after ")
    assert report.budget_note in summary and "not tuned (" in summary
    assert summary.splitlines()[-1] == ("run the same command again to resume: trials "
                                        f"measured so far are kept in {tmp_path / 'ms'}")
    # stderr is not a terminal here: whole lines, one per update
    assert "\r" not in err and "\x1b" not in err and err.endswith("\n")
    assert all(line.startswith(("[1/3] ", "time budget of 5 s")) for line in err.splitlines())


def test_a_step_that_would_pass_the_budget_is_not_started():
    budget = _Budget(100)
    assert budget.fits("anything", ("trial", 50)), "nothing measured yet: no estimate"
    budget.took("trial", 3.0, 2)                       # 1.5 s a trial
    budget.took("closing measurement", 4.0)
    budget.deadline -= 60                              # 40 s left
    assert budget.fits("the next 16 trials", ("trial", 16), ("closing measurement", 1))
    assert budget.refused is None
    assert not budget.fits("the next 32 trials", ("trial", 32), ("closing measurement", 1))
    assert budget.refused == "the next 32 trials (about 52 s) would have passed it (40 s left)"
    assert _Budget(None).fits("anything", ("trial", 10 ** 9))


def test_a_kernel_whose_search_would_pass_the_budget_is_not_started(tmp_path, monkeypatch,
                                                                    capsys):
    """As if an earlier kernel's search had taken 1000 s: with 100 s of budget the first
    kernel is not started, and the report says so."""
    import mhagen.tuning.search as search

    class Measured(search._Budget):
        def __init__(self, seconds):
            super().__init__(seconds)
            self.took("search start", 1000.0)
    monkeypatch.setattr(search, "_Budget", Measured)
    report = tune(mhagen.mha(64, 2), shapes=[(1, 16)], trials=2, time_budget=100,
                  database=tmp_path / "db.json", work_dir=tmp_path / "ms")
    assert report.stopped_by == "the time budget" and report.results == []
    assert report.untuned == ["qkv_projection 1x16", "attention 1x16",
                              "output_projection 1x16"]
    assert report.budget_note.startswith(
        "time budget of 100 s: qkv_projection 1x16's search (about 1000 s) would have "
        "passed it (")
    assert capsys.readouterr().err.splitlines()[-1] == report.budget_note
    assert not (tmp_path / "db.json").exists() or '"records": []' in (
        tmp_path / "db.json").read_text()


def _events(bar):
    bar.kernel(1, "qkv_projection 1x16", 4)
    bar.trials(2)
    bar.trials(2)
    bar.result(KernelResult((1, 16), "qkv_projection", "metaschedule", 4, 12.71, 9.64,
                            "tuned"))
    bar.message("time budget of 5 s: cut attention 1x16 at the deadline; stopped after 5 s")


def test_progress_off_a_terminal_is_one_line_per_update():
    stream = io.StringIO()
    _events(_Progress(True, 3, _Budget(None), stream))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    assert [" ".join(line.split()[:5]) for line in lines[:3]] == [
        f"[1/3] qkv_projection 1x16 {done}/4 trials" for done in (0, 2, 4)]
    # the kernel's closing line gives the numbers its row of the table gives
    assert "default 12.7 us, tuned 9.6 us: kept tuned" in lines[3]
    assert len(lines) == 5 and lines[4].startswith("time budget of 5 s")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_is_redrawn_in_place():
    stream = _Terminal()
    _events(_Progress(True, 3, _Budget(None), stream))
    out = stream.getvalue()
    assert out.count("\n") == 2, "only the closing line and the message end a line"
    assert out.count("\r") == 4 and "[####" in out


def test_the_table_says_how_it_timed_and_where_the_budget_cut_a_search(tmp_path):
    report = TuneReport(tmp_path / "db.json", work_dir=tmp_path / "ms", seconds=127.4,
                        results=[KernelResult((1, 16), "qkv_projection", "metaschedule", 5,
                                              18.7, 15.6, "tuned", planned=20)])
    table = report.table()
    assert "search stopped by the time budget after 5 of 20 trials" in table
    assert table.splitlines()[-1].startswith("us: median time per call")
    assert report.summary() == f"done in 127 s; records in {tmp_path / 'db.json'}"


def test_ctrl_c_summary_says_how_to_resume(tmp_path):
    report = TuneReport(tmp_path / "db.json", work_dir=tmp_path / "ms", seconds=127.4,
                        interrupted=True, stopped_by="Ctrl-C", untuned=["attention 1x16"])
    first, untuned, resume = report.summary().splitlines()
    assert first == ("stopped by Ctrl-C: kept what was measured, after 127 s of tuning; "
                     f"records in {tmp_path / 'db.json'}")
    assert untuned == "not tuned (1): attention 1x16"
    assert resume.startswith("run the same command again to resume")


@pytest.mark.parametrize("budget", [None, 3600])
def test_the_budget_never_cuts_a_run_that_fits(budget):
    bar = _Progress(False, 1, _Budget(budget))
    with bar.budget.cut_at_deadline(bar):
        pass
    bar.check()   # no stop raised: time is left
    assert not bar.stopped


@pytest.mark.parametrize("seconds", [0, -5, float("nan"), float("inf"), "60"])
def test_a_time_budget_that_is_not_a_positive_number_is_refused(tmp_path, seconds):
    with pytest.raises(mhagen.MhagenError, match="positive number, not"):
        tune(mhagen.mha(64, 2), shapes=[(1, 16)], time_budget=seconds,
             database=tmp_path / "db.json")
    assert not (tmp_path / "db.json").exists()
