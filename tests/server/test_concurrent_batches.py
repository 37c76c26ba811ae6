"""``--concurrent-batches``: several batches at once on the one copy of a model, and no answer that
depends on it.

The batcher's workers (the fake backend function of test_batcher.py), the start-up check that
calls running at once give the outputs of the same calls alone (on the real CPU backends, and on
a backend built to fail it), the refusal on GPUs and the split of the intra-op threads. A live
server's answers under concurrent batches, alone and among 31 others, are checked in
test_determinism.py (its ``concurrent2`` servers).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import numpy as np
import pytest

from server.batching.batcher import FatalBackendError, Result
from server.errors import Unavailable
from server.registry import ModelLoadError, backend_threads, check_concurrent_batches, load_served_model
from server.settings import Settings

from helpers.batching import D, HANG, FakeFn, make, outcome, row  # noqa: F401 - make: a fixture


def test_two_workers_run_two_batches_at_once(make):
    # Each call waits inside the backend until a second call is inside too: with one worker the
    # barrier breaks and every item fails.
    fn = FakeFn(barrier=threading.Barrier(2))
    b, q = make(fn, max_batch_size=4, max_delay_s=60.0, workers=2)
    b.start()

    async def main():
        futs = [b.submit(q, row(float(i)), 30) for i in range(8)]
        return await asyncio.wait_for(asyncio.gather(*futs), HANG * 2)

    results = asyncio.run(main())
    assert fn.shapes == [(4, D), (4, D)]
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)


@pytest.mark.parametrize("pad", [False, True])
def test_every_item_computed_once_by_three_workers(make, pad):
    fn = FakeFn()
    b, q = make(fn, max_batch_size=4, max_delay_s=0.001, max_queue=300, workers=3, pad=pad)
    b.start()

    async def main():
        futs = []
        for i in range(1, 301):  # no item is 0.0: that is padding
            futs.append(b.submit(q, row(float(i)), 30))
            if i % 7 == 0:
                await asyncio.sleep(0)  # arrivals spread over loop turns: batches of every size
        return await asyncio.wait_for(asyncio.gather(*futs), HANG * 4)

    results = asyncio.run(main())
    for i, r in enumerate(results, start=1):
        assert isinstance(r, Result)
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)
    assert sorted(v for v in fn.seen() if v != 0.0) == [float(i) for i in range(1, 301)]  # each exactly once
    assert b.calls == len(fn.calls)


def test_a_fatal_error_on_one_worker_stops_every_worker(make):
    gate = threading.Event()

    def fail(rows):
        return FatalBackendError("device lost") if rows["x"][0, 0] == 99.0 else None

    held = FakeFn(gate=gate)  # the other worker is inside a call of this queue when the fatal one comes
    fatal = FakeFn(fail=fail)
    b, q_held, q_fatal = make(held, fatal, max_batch_size=1, max_delay_s=0.0, workers=2)
    b.start()

    async def main():
        first = b.submit(q_held, row(1.0), 30)
        while not held.entered.is_set():
            await asyncio.sleep(0.001)
        doomed = b.submit(q_fatal, row(99.0), 30)
        got = await outcome(doomed)
        gate.set()  # the call in flight on the other worker still answers
        return got, await outcome(first)

    doomed, first = asyncio.run(main())
    assert isinstance(doomed, Unavailable)
    assert isinstance(first, Result)
    assert b.dead and not b.alive

    async def after():
        return b.submit(q_held, row(2.0), 30)

    with pytest.raises(Unavailable):
        asyncio.run(after())


def test_workers_must_be_positive():
    from server.batching.batcher import Batcher

    with pytest.raises(ValueError, match="workers"):
        Batcher("cpu", workers=0)


# ------------------------------------------------------------------ the start-up check, real backends


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_start_up_check_passes_on_the_cpu_backends(packages, tmp_path, backend):
    settings = Settings(backend=backend, concurrent_batches=2, threads=2, max_batch_size=4, cache_dir=str(tmp_path))
    import torch

    threads = torch.get_num_threads()
    model = load_served_model(f"golden={packages['golden']}", settings, log=lambda m: None)
    try:
        lines = []
        check_concurrent_batches(model, settings, log=lines.append)
        assert lines == ["golden: 2 concurrent batches give outputs bitwise equal to calls alone (classify, routing)"]
    finally:
        model.backend.close()
        torch.set_num_threads(threads)


class ThreadDependent:
    """A real backend whose outputs move by one ulp when the call comes from another thread than
    the one that built it: what a backend sharing state between calls looks like from outside."""

    def __init__(self, inner, fail: bool = False) -> None:
        self.inner, self.functions, self.routing = inner, inner.functions, inner.routing
        self.owner, self.fail = threading.get_ident(), fail

    def run(self, fn, rows):
        out = self.inner.run(fn, rows)
        if threading.get_ident() != self.owner:
            if self.fail:
                raise RuntimeError("called from another thread")
            out = {k: np.nextafter(v, np.inf).astype(v.dtype) for k, v in out.items()}
        return out


@contextlib.contextmanager
def thread_dependent(packages, tmp_path, fail: bool = False, **settings):
    """The golden model on ONNX Runtime behind ``ThreadDependent``, and its settings."""
    settings = Settings(backend="onnxruntime", max_batch_size=4, cache_dir=str(tmp_path), **settings)
    model = load_served_model(f"golden={packages['golden']}", settings, log=lambda m: None)
    try:
        model.backend = ThreadDependent(model.backend, fail=fail)
        yield model, settings
    finally:
        model.backend.inner.close()


@pytest.mark.parametrize("n,fail,why", [
    (3, False, r"3 concurrent calls at batch 1 gave outputs that differ .* use --concurrent-batches 1"),
    (2, True, r"2 concurrent calls at batch 1 failed \(RuntimeError: called from another thread\)"),
])
def test_start_up_check_refuses_answers_that_depend_on_the_call_beside(packages, tmp_path, n, fail, why):
    with thread_dependent(packages, tmp_path, fail, concurrent_batches=n, threads=n) as (model, settings):
        with pytest.raises(ModelLoadError, match=rf"golden/classify: {why}"):
            check_concurrent_batches(model, settings, log=lambda m: None)


def test_one_batch_at_a_time_is_not_checked(packages, tmp_path):
    with thread_dependent(packages, tmp_path) as (model, settings):
        lines = []
        check_concurrent_batches(model, settings, log=lines.append)  # nothing runs beside anything
        assert lines == []


# ------------------------------------------------------------------ where it runs, and on how many threads


@pytest.mark.parametrize("device,backend", [("cuda", "torch"), ("cuda", "onnxruntime"), ("cpu", "tensorrt")])
def test_refused_where_not_verified(packages, device, backend):
    settings = Settings(device=device, backend=backend, concurrent_batches=2)
    with pytest.raises(ModelLoadError, match=r"^--concurrent-batches 2 runs CPU backends only"):
        load_served_model(f"golden={packages['golden']}", settings, log=lambda m: None)


def test_refused_beyond_one_thread_each(packages):
    cpus = len(os.sched_getaffinity(0))
    with pytest.raises(ModelLoadError, match=r"^--concurrent-batches 3 is more batches at once than the 2 intra-op "
                                             r"threads \(--threads\) can run, one thread each; use at most 2"):
        load_served_model(f"golden={packages['golden']}", Settings(concurrent_batches=3, threads=2), log=lambda m: None)
    with pytest.raises(ModelLoadError, match=rf"the {cpus} intra-op threads \(the CPUs available\)"):
        load_served_model(f"golden={packages['golden']}", Settings(concurrent_batches=cpus + 1), log=lambda m: None)


def test_intra_op_threads_are_divided():
    cpus = len(os.sched_getaffinity(0))
    assert backend_threads(Settings(threads=4)) == 4
    assert backend_threads(Settings(threads=0)) == 0  # the backend's own default
    assert backend_threads(Settings(threads=4, concurrent_batches=2)) == 2
    assert backend_threads(Settings(threads=5, concurrent_batches=2)) == 2
    assert backend_threads(Settings(threads=0, concurrent_batches=2)) == max(1, cpus // 2)
