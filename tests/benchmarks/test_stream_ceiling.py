"""benchmarks.studies.stream_ceiling: the loop builds on this CPU and its figures obey what the
loop does (not timings: no figure is compared with a fixed number)."""
from benchmarks.studies import stream_ceiling


def test_the_stream_loop_runs_and_more_work_a_line_is_never_faster_in_l1():
    report = stream_ceiling.measure(mib=64, work=(0, 16), passes=1)
    assert report["unit"] in ("avx512-vnni", "avx2")
    rows = {(r["work"], r["prefetch"]): r["gb_s"] for r in report["rows"]}
    assert set(rows) == {(w, p) for w in (0, 16) for p in ("none", "t0 2 KB", "t1 2 KB", "in L1")}
    assert all(v > 0 for v in rows.values())
    # Sixteen products a line in L1 cost the loop at least what one add a line does
    assert rows[(16, "in L1")] < rows[(0, "in L1")]
    # Streamed from memory, the work cannot go faster than it does on bytes already in L1 (a
    # quarter of slack for a busy host between the two passes)
    assert max(rows[(16, p)] for p in ("none", "t0 2 KB", "t1 2 KB")) < 1.25 * rows[(16, "in L1")]
