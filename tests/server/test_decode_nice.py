"""--decode-nice: the decode threads, and only they, run at the process's niceness plus N."""

from __future__ import annotations

import os
import threading

import pytest

from server.api.service import Service, lower_priority
from server.settings import Settings

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join()
    return out["v"]


def test_lower_priority_moves_the_calling_thread_only():
    base = _nice()
    assert _in_thread(lambda: (lower_priority(5), _nice())[1]) == min(19, base + 5)
    assert _nice() == base  # the caller's own thread and process are untouched
    assert _in_thread(lambda: (lower_priority(0), _nice())[1]) == base
    assert _in_thread(lambda: (lower_priority(40), _nice())[1]) == 19  # clamped, no error


@pytest.mark.parametrize("nice", [0, 7])
def test_service_decode_pool_runs_at_the_setting(nice):
    base = _nice()
    service = Service(Settings(decode_nice=nice, decode_workers=2), {}, None, None)
    try:
        seen = {service.pool.submit(_nice).result() for _ in range(8)}
        assert seen == {min(19, base + nice)}
        assert _nice() == base
    finally:
        service.pool.shutdown()


def test_out_of_range_is_refused():
    with pytest.raises(ValueError, match="decode_nice"):
        Settings(decode_nice=20)
