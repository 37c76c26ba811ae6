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
import re
import threading

import numpy as np
import pytest

from server.batching.batcher import FatalBackendError, Result
from server.errors import Unavailable
from server.engine.proofs import check_concurrent_batches
from server.engine.models import ModelLoadError, backend_threads, load_served_model
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


# ------------------------------------------------------------------ wide lone calls: ModelQueue.plan


class Lanes:
    """A plan and the queue function that reads its decision on the worker: x * 2 either way,
    recording which lane each call took."""

    def __init__(self, gate: threading.Event | None = None, barrier: threading.Barrier | None = None) -> None:
        self.asked: list[bool] = []
        self.lanes: list[str] = []
        self.decided = threading.local()
        self.inner = FakeFn(gate=gate, barrier=barrier)

    def plan(self, beside: bool) -> bool:
        self.asked.append(beside)
        self.decided.lane = "beside" if beside else "alone"
        return beside

    def __call__(self, rows):
        self.lanes.append(self.decided.lane)
        return self.inner(rows)


def test_a_plan_runs_batches_beside_each_other_when_more_wait(make):
    # Eight items, batches of 4: the first worker sees more waiting, the second sees a call
    # running; both run beside (a barrier of 2: they must really run at once).
    lanes = Lanes(barrier=threading.Barrier(2))
    b, q = make(lanes, max_batch_size=4, max_delay_s=60.0, workers=2)
    q.plan = lanes.plan

    async def main():
        futs = [b.submit(q, row(float(i)), 30) for i in range(8)]
        b.start()
        return await asyncio.wait_for(asyncio.gather(*futs), HANG * 2)

    results = asyncio.run(main())
    assert lanes.asked == [True, True] and lanes.lanes == ["beside", "beside"] and b.alone_calls == 0
    assert lanes.inner.shapes == [(4, D), (4, D)]
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)


def test_a_lone_batch_runs_alone(make):
    lanes = Lanes()
    b, q = make(lanes, max_batch_size=4, max_delay_s=0.0, workers=2)
    q.plan = lanes.plan
    b.start()

    async def main():
        return await asyncio.wait_for(b.submit(q, row(1.0), 30), HANG)

    np.testing.assert_array_equal(asyncio.run(main()).outputs["y"], row(1.0)["x"] * 2)
    assert lanes.asked == [False] and lanes.lanes == ["alone"] and b.alone_calls == 1


@pytest.mark.parametrize("alone_first", [True, False], ids=["nothing-starts-beside-it", "it-waits-for-the-running"])
def test_a_call_that_runs_alone_never_shares_the_device(make, alone_first):
    # The first call is held inside the backend; the second, of another queue, has a free worker.
    # A call running alone holds the device (the second waits for it to end), and a call meant to
    # run alone waits for the call running to end.
    gate = threading.Event()
    first_fn, second_fn = FakeFn("first", gate=gate), FakeFn("second")
    b, q_first, q_second = make(first_fn, second_fn, max_batch_size=1, max_delay_s=0.0, workers=2)
    (q_first if alone_first else q_second).plan = lambda beside: False
    b.start()

    async def main():
        first = b.submit(q_first, row(1.0), 30)
        assert await asyncio.to_thread(first_fn.entered.wait, HANG)
        second = b.submit(q_second, row(2.0), 30)
        await asyncio.sleep(0.3)
        assert not second_fn.entered.is_set(), "a call started beside another while one of them runs alone"
        gate.set()
        return await asyncio.wait_for(asyncio.gather(first, second), HANG)

    asyncio.run(main())
    assert second_fn.shapes == [(1, D)] and b.alone_calls == 1


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


@pytest.mark.parametrize("backend,wide,checked", [
    ("torch", True, "classify, routing"),  # --wide-lone-batches is onnxruntime's: every call runs beside
    ("onnxruntime", False, "classify, routing"),
    ("onnxruntime", True, "classify"),  # the routing graph's session runs alone: never beside anything
])
def test_start_up_check_passes_on_the_cpu_backends(packages, tmp_path, backend, wide, checked):
    settings = Settings(backend=backend, concurrent_batches=2, threads=2, max_batch_size=4, cache_dir=str(tmp_path),
                        wide_lone_batches=wide)
    import torch

    threads = torch.get_num_threads()
    model = load_served_model(f"golden={packages['golden']}", settings, log=lambda m: None)
    try:
        lines = []
        check_concurrent_batches(model, settings, log=lines.append)
        assert lines == [f"golden: 2 concurrent batches give outputs bitwise equal to calls alone ({checked})"]
    finally:
        model.backend.close()
        torch.set_num_threads(threads)


class ThreadDependent:
    """A real backend whose outputs move by one ulp when the call comes from another thread than
    the one that built it: what a backend sharing state between calls looks like from outside."""

    def __init__(self, inner, fail: bool = False) -> None:
        self.inner, self.functions, self.routing = inner, inner.functions, inner.routing
        self.narrow = getattr(inner, "narrow", set())
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


def test_a_failure_beside_is_refused_not_timed(packages, tmp_path, monkeypatch):
    # --wide-lone-beside auto times N full batches beside each other: a call that raises there must
    # stop the start-up, not read as a fast call (and so as a gain that chooses running beside).
    from server.engine import proofs

    monkeypatch.setattr(proofs, "BESIDE_MIN_MS", 0.0)  # the golden model is light: measure anyway
    with thread_dependent(packages, tmp_path, True, concurrent_batches=2, threads=2) as (model, settings):
        with pytest.raises(ModelLoadError, match=r"golden/classify: 2 batches of 4 beside each other failed "
                           r"\(RuntimeError: called from another thread\)"):
            proofs._beside_pays(model, settings, 4, np.random.default_rng(0), lambda m: None)


def test_one_batch_at_a_time_is_not_checked(packages, tmp_path):
    with thread_dependent(packages, tmp_path, concurrent_batches=1) as (model, settings):
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


def _intra_threads(session) -> int:
    return session.get_session_options().intra_op_num_threads


@pytest.mark.parametrize("wide", [True, False])
def test_one_session_holds_the_weights_and_serves_both(packages, tmp_path, wide):
    # The classifier is served by its routing graph's session (one copy of the weights): every thread
    # under --wide-lone-batches, where calls at load run beside each other on it; else a share.
    settings = Settings(concurrent_batches=2, threads=2, max_batch_size=4, cache_dir=str(tmp_path),
                        wide_lone_batches=wide)
    model = load_served_model(f"golden={packages['golden']}", settings, log=lambda m: None)
    try:
        sessions = model.backend.sessions
        assert sessions["classify"] is sessions["routing"]
        assert _intra_threads(sessions["routing"]) == (2 if wide else 1)
        assert model.backend.narrow == ({"classify"} if wide else set())
        assert model.backend.functions["classify"].outputs == ("logits", "pre_logits")
        rows = {"pixel_values": np.random.default_rng(0).uniform(-1, 1, (4, 3, 32, 32)).astype(np.float32)}
        plain, routing = model.backend.run("classify", rows), model.backend.run("routing", rows)
        assert plain.keys() == {"logits", "pre_logits"} and "dispatch_entropy" in routing
        assert all(np.array_equal(plain[k], routing[k]) for k in plain)
    finally:
        model.backend.close()


def test_without_routing_the_plain_graph_has_its_own_session(packages, tmp_path):
    settings = Settings(max_batch_size=4, cache_dir=str(tmp_path), routing=False)
    model = load_served_model(f"golden={packages['golden']}", settings, log=lambda m: None)
    try:
        assert set(model.backend.sessions) == {"classify"} and model.backend.routing is None
    finally:
        model.backend.close()


def test_wide_lone_plan_after_the_proof(packages, tmp_path):
    """The plan of a served model's classify queue: before the start-up proof every call runs beside
    on the classify session; after it, alone on the routing graph (the same outputs) unless beside
    pays, and a sampled call always alone, with the statistics."""
    from server.http.app import create_app
    from server.engine.proofs import prove_routing

    from helpers.live import live_server

    settings = Settings(models=[f"golden={packages['golden']}"], concurrent_batches=2, threads=2, max_batch_size=4,
                        cache_dir=str(tmp_path), routing_stats_sample=3, wide_lone_beside="always")
    with live_server(create_app(settings)) as url:
        import httpx

        params = httpx.get(f"{url}/v2/models/golden", timeout=10).json()["parameters"]
        assert params["concurrent_batches"] == 2
        assert params["wide_lone_batches"] == {"proven": True, "beside": True}
    model = load_served_model(f"golden={packages['golden']}", settings, log=lambda m: None)
    try:
        from server.batching.batcher import Batcher

        from server.engine.models import attach_queues
        from server.metrics import Metrics

        attach_queues(model, Batcher("cpu", workers=2), settings, Metrics())
        queue, state = model.queues["classify"], model.routing
        assert state.lone and not state.shared
        assert queue.plan(False)  # not proven yet: beside, on the classify session
        lines = []
        assert prove_routing(model, settings, log=lines.append)
        assert lines == ["golden: the routing function's classify outputs are the plain one's, bitwise, at [4]"], lines
        assert state.why == "--wide-lone-beside always"
        rows = {"pixel_values": np.random.default_rng(0).uniform(-1, 1, (4, 3, 32, 32)).astype(np.float32)}
        want = model.backend.run("classify", rows)
        state.calls = 0
        beside, outs = [], []
        for worth in (True, False, True):  # the third call is sampled (1 in 3): alone, whatever is worth it
            beside.append(queue.plan(worth))
            outs.append(queue.fn(rows))  # on this thread, as a worker calls it after its plan
        assert beside == [True, False, False]
        for out in outs:
            assert all(np.array_equal(out[k], v) for k, v in want.items())
        assert "dispatch_entropy" in outs[2] and not any("dispatch_entropy" in o for o in outs[:2])
        state.beside = False  # a light model: every call alone
        assert queue.plan(True) is False
    finally:
        model.backend.close()


@pytest.mark.parametrize("beside,want", [("auto", r"a batch of 4 takes [0-9.]+ ms, too short to share the cores"),
                                         ("never", "--wide-lone-beside never")])
def test_a_light_model_runs_every_call_alone(packages, tmp_path, beside, want):
    # The golden model's batch of 4 takes about a millisecond: under the 20 ms where running beside
    # pays, so auto measures no further.
    from server.engine.proofs import prove_routing, serving_line

    settings = Settings(concurrent_batches=2, threads=2, max_batch_size=4, cache_dir=str(tmp_path),
                        wide_lone_beside=beside)
    model = load_served_model(f"golden={packages['golden']}", settings, log=lambda m: None)
    try:
        model.routing.lone = True
        lines = []
        assert prove_routing(model, settings, log=lines.append)
        assert model.routing.shared and not model.routing.beside
        assert re.fullmatch(want, model.routing.why), model.routing.why
        assert serving_line(model, settings).endswith(f"; every batch alone with 2 intra-op threads ({model.routing.why})")
    finally:
        model.backend.close()


def test_auto_concurrency():
    cpus = len(os.sched_getaffinity(0))
    assert Settings().concurrent_batches == (2 if cpus >= 2 else 1)
    assert Settings(threads=2).concurrent_batches == 2
    assert Settings(threads=1).concurrent_batches == 1
    assert Settings(threads=2, backend="torch").concurrent_batches == 1
    assert Settings(threads=2, wide_lone_batches=False).concurrent_batches == 1
    assert Settings(threads=2, concurrent_batches=1).concurrent_batches == 1


def test_intra_op_threads_are_divided():
    cpus = len(os.sched_getaffinity(0))
    assert backend_threads(Settings(threads=4, concurrent_batches=1)) == 4
    assert backend_threads(Settings(threads=0, concurrent_batches=1)) == 0  # the backend's own default
    assert backend_threads(Settings(threads=4, concurrent_batches=2)) == 2
    assert backend_threads(Settings(threads=5, concurrent_batches=2)) == 2
    assert backend_threads(Settings(threads=0, concurrent_batches=2)) == max(1, cpus // 2)
