"""How `lattice status` and `submit --watch` write durations and where a job's time went."""

from __future__ import annotations

from service.cli.jobs import duration, goodput_text


def test_durations_are_short() -> None:
    assert [duration(x) for x in (None, 0.25, 59.94, 245, 7620)] == ["-", "0.2s", "59.9s", "4m05s", "2h07m"]


def test_goodput_lists_the_parts_that_took_time_largest_first() -> None:
    parts = {"useful_s": 120.0, "startup_s": 9.5, "queued_s": 0.0, "restarting_s": 0.0, "lost_s": 1.25,
             "checkpoint_s": 0.0}
    assert goodput_text(parts) == "useful 2m00s, startup 9.5s, lost 1.2s"
    assert goodput_text({}) == "-"
