"""A load's phases: each second counted once, in the innermost phase; nothing outside a recording."""

from __future__ import annotations

import threading
import time

from export import phases


def test_nested_phases_count_each_second_once():
    with phases.recording() as record:
        with phases.phase("export"):
            time.sleep(0.05)
            with phases.phase("hash"):
                time.sleep(0.1)
                assert record.now()[0] == "hash"
            time.sleep(0.05)
        with phases.phase("session"):
            time.sleep(0.02)
    seconds = dict(record.ordered())
    assert [name for name, _ in record.ordered()] == ["hash", "export", "session"]  # ORDER, not arrival
    assert 0.1 <= seconds["hash"] < 0.15
    assert 0.1 <= seconds["export"] < 0.15  # its own time, the hashing inside it left out
    assert abs(sum(seconds.values()) - (time.perf_counter() - record.started)) < 0.05
    assert record.now() is None
    assert record.summary().startswith("hash 0.1 s, export 0.1 s, session 0.0 s")


def test_outside_a_recording_a_phase_does_nothing():
    assert phases.current() is None
    with phases.phase("export"):
        assert phases.current() is None


def test_a_thread_started_inside_sees_no_recording():
    seen = []
    with phases.recording():
        thread = threading.Thread(target=lambda: seen.append(phases.current()))
        thread.start()
        thread.join()
        assert phases.current() is not None
    assert seen == [None]


def test_another_thread_reads_where_a_load_is():
    record = phases.Phases()
    entered, leave = threading.Event(), threading.Event()

    def load():
        with phases.recording(record), phases.phase("bind"):
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=load)
    thread.start()
    entered.wait(10)
    name, seconds = record.now()
    leave.set()
    thread.join()
    assert name == "bind" and seconds >= 0
    assert record.now() is None and "bind" in record.seconds
