"""Unit tests of the dynamic batcher (``server.batching.batcher``), with no FastAPI or HTTP.

A fake backend function records every call's stacked rows. Tests that need an item to wait in
the queue hold the worker inside the backend with a ``threading.Event`` (never a sleep that
the test's correctness depends on). Timeouts below only guard against hangs; no test asserts a
duration.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from prometheus_client import generate_latest

from server.batching.batcher import Batcher, FatalBackendError, ModelQueue, Result
from server.errors import BackendFailure, DeadlineExceeded, InferenceFailed, QueueFull, Unavailable
from server.metrics import Metrics

from helpers.batching import D, HANG, FakeFn, counter, gauge, make, outcome, row, wait_event  # noqa: F401 - make: a fixture


# ---------------------------------------------------------------------------------------- (a)


def test_results_per_item_in_order(make):
    fn = FakeFn()
    b, q = make(fn, max_batch_size=4)
    b.start()

    async def main():
        futs = [b.submit(q, row(float(i)), 10) for i in range(7)]
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    results = asyncio.run(main())
    assert len(results) == 7
    for i, r in enumerate(results):
        assert isinstance(r, Result)
        assert set(r.outputs) == {"y"}
        assert r.outputs["y"].shape == (D,)  # its own row, batch axis removed
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)
        assert set(r.timings) == {"queue", "inference", "started", "batch_id", "batch_size"}
        assert all(v >= 0 for v in r.timings.values())
    calls = {}
    for r in results:  # one batch id per backend call, its size the call's real items
        calls.setdefault(r.timings["batch_id"], []).append(r.timings["batch_size"])
    assert all(sizes == [len(sizes)] * len(sizes) for sizes in calls.values())
    assert sum(len(s) for s in calls.values()) == 7
    assert sorted(fn.seen()) == [float(i) for i in range(7)]  # every item computed exactly once


# ---------------------------------------------------------------------------------------- (b)


def test_submits_within_max_delay_share_one_call(make):
    # The batch fires only when full (the delay is far longer than the test): one call of 4.
    fn = FakeFn()
    b, q = make(fn, max_batch_size=4, max_delay_s=60.0)
    b.start()

    async def main():
        futs = [b.submit(q, row(float(i)), 120) for i in range(4)]
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    results = asyncio.run(main())
    assert fn.shapes == [(4, D)]
    assert b.calls == 1
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)


def test_partial_batch_fires_after_max_delay(make):
    # Three submits in one event-loop turn, well inside a 0.2 s window: one call with 3 items.
    fn = FakeFn()
    b, q = make(fn, max_batch_size=8, max_delay_s=0.2)
    b.start()

    async def main():
        futs = [b.submit(q, row(float(i)), 10) for i in range(3)]
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    asyncio.run(main())
    assert fn.shapes == [(3, D)]


def test_max_batch_size_caps_a_call(make):
    fn = FakeFn()
    b, q = make(fn, max_batch_size=3, max_delay_s=0.02)

    async def main():
        futs = [b.submit(q, row(float(i)), 10) for i in range(7)]
        b.start()  # everything is queued before the worker looks: deterministic split
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    results = asyncio.run(main())
    assert fn.shapes == [(3, D), (3, D), (1, D)]
    assert fn.seen() == [float(i) for i in range(7)]  # FIFO within a queue
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)


# ---------------------------------------------------------------------------------------- (c)


def test_strict_padding_fixed_shape(make):
    fn = FakeFn()
    metrics = Metrics()
    b, q = make(fn, max_batch_size=4, max_delay_s=0.02, pad=True, metrics=metrics, labels=["p"])

    async def main():
        futs = [b.submit(q, row(float(i + 1)), 10) for i in range(2)]
        b.start()
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    results = asyncio.run(main())
    assert fn.shapes == [(4, D)]
    x = fn.calls[0]["x"]
    assert x.dtype == np.float32
    np.testing.assert_array_equal(x[:2], np.stack([row(1.0)["x"], row(2.0)["x"]]))
    np.testing.assert_array_equal(x[2:], np.zeros((2, D), np.float32))  # zero padding
    for i, r in enumerate(results):
        assert r.outputs["y"].shape == (D,)
        np.testing.assert_array_equal(r.outputs["y"], row(float(i + 1))["x"] * 2)
    # padding is excluded from the batch-size metric and reported as its ratio
    assert metrics.batch_size.labels("p")._sum.get() == 2
    assert metrics.batch_padding_ratio.labels("p")._sum.get() == pytest.approx(0.5)
    assert metrics.batches.labels("p")._value.get() == 1


def test_every_padded_call_has_max_batch_size_rows(make):
    fn = FakeFn()
    b, q = make(fn, max_batch_size=4, max_delay_s=0.02, pad=True)

    async def main():
        futs = [b.submit(q, row(float(i + 1)), 10) for i in range(6)]
        b.start()
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    results = asyncio.run(main())
    assert fn.shapes == [(4, D), (4, D)]
    np.testing.assert_array_equal(fn.calls[1]["x"][2:], 0)
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i + 1))["x"] * 2)


def test_no_padding_call_has_exactly_n_rows(make):
    fn = FakeFn()
    b, q = make(fn, max_batch_size=4, max_delay_s=0.02, pad=False)

    async def main():
        futs = [b.submit(q, row(float(i + 1)), 10) for i in range(2)]
        b.start()
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    results = asyncio.run(main())
    assert fn.shapes == [(2, D)]
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i + 1))["x"] * 2)


def test_padded_and_unpadded_outputs_agree(make):
    fa, fb = FakeFn(), FakeFn()
    ba, qa = make(fa, max_batch_size=4, pad=True)
    bb, qb = make(fb, max_batch_size=4, pad=False)
    ba.start()
    bb.start()

    async def main():
        ra = await asyncio.wait_for(asyncio.gather(*[ba.submit(qa, row(float(i)), 10) for i in range(3)]), HANG)
        rb = await asyncio.wait_for(asyncio.gather(*[bb.submit(qb, row(float(i)), 10) for i in range(3)]), HANG)
        return ra, rb

    ra, rb = asyncio.run(main())
    for x, y in zip(ra, rb):
        np.testing.assert_array_equal(x.outputs["y"], y.outputs["y"])
    assert all(s[0] == 4 for s in fa.shapes)
    assert sum(s[0] for s in fb.shapes) == 3


# ---------------------------------------------------------------------------------------- (d)


def test_queue_full_raises_429_with_retry_after(make):
    fn = FakeFn()
    metrics = Metrics()
    b, q = make(fn, max_batch_size=4, max_delay_s=0.01, max_queue=2, metrics=metrics, labels=["full"])

    async def main():
        futs = [b.submit(q, row(float(i)), 10) for i in range(2)]  # the worker is not started
        with pytest.raises(QueueFull) as info:
            b.submit(q, row(9.0), 10)
        assert b.depth(q) == 2
        b.start()
        return info.value, await asyncio.wait_for(asyncio.gather(*futs), HANG)

    err, results = asyncio.run(main())
    assert err.status == 429
    assert "Retry-After" in err.headers and int(err.headers["Retry-After"]) >= 1
    assert err.body()["error"]["code"] == 429
    assert counter(metrics, "full", "queue_full") == 1
    assert [float(r.outputs["y"][0]) for r in results] == [0.0, 2.0]  # the queued ones still run
    assert 9.0 not in fn.seen()


def test_queue_accepts_again_once_drained(make):
    fn = FakeFn()
    b, q = make(fn, max_batch_size=1, max_queue=1)
    b.start()

    async def main():
        for i in range(3):
            r = await asyncio.wait_for(b.submit(q, row(float(i)), 10), HANG)
            np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)

    asyncio.run(main())


# ---------------------------------------------------------------------------------------- (e)


def test_deadline_expired_item_never_reaches_backend(make):
    gate = threading.Event()
    fn = FakeFn(gate=gate)
    metrics = Metrics()
    b, q = make(fn, max_batch_size=1, metrics=metrics, labels=["dl"])
    b.start()

    async def main():
        first = b.submit(q, row(1.0), 30)
        await wait_event(fn.entered)  # the worker is busy with `first`
        late = b.submit(q, row(2.0), 0.01)
        await asyncio.sleep(0.05)  # its deadline is now behind it (it is still queued)
        gate.set()
        return await outcome(first), await outcome(late)

    first, late = asyncio.run(main())
    assert isinstance(first, Result)
    np.testing.assert_array_equal(first.outputs["y"], row(1.0)["x"] * 2)
    assert isinstance(late, DeadlineExceeded)
    assert late.status == 504
    assert fn.seen() == [1.0]  # the late item never reached the backend
    assert b.calls == 1
    assert counter(metrics, "dl", "deadline") == 1


# ---------------------------------------------------------------------------------------- (f)


def test_cancelled_item_dropped_before_compute(make):
    gate = threading.Event()
    fn = FakeFn(gate=gate)
    metrics = Metrics()
    b, q = make(fn, max_batch_size=4, max_delay_s=0.01, metrics=metrics, labels=["c"])
    b.start()

    async def main():
        first = b.submit(q, row(1.0), 30)
        await wait_event(fn.entered)
        gone = b.submit(q, row(2.0), 30)
        kept = b.submit(q, row(3.0), 30)
        gone.cancel()  # the client left while the item was queued
        gate.set()
        return await outcome(first), await outcome(kept), gone

    first, kept, gone = asyncio.run(main())
    assert gone.cancelled()
    np.testing.assert_array_equal(first.outputs["y"], row(1.0)["x"] * 2)
    np.testing.assert_array_equal(kept.outputs["y"], row(3.0)["x"] * 2)
    assert fn.seen() == [1.0, 3.0]  # 2.0 was never computed
    assert sum(s[0] for s in fn.shapes) == 2
    assert counter(metrics, "c", "cancelled") == 1


def test_all_cancelled_batch_makes_no_call(make):
    fn = FakeFn()
    b, q = make(fn, max_batch_size=4, max_delay_s=0.01)

    async def main():
        futs = [b.submit(q, row(float(i)), 30) for i in range(3)]
        for f in futs:
            f.cancel()
        b.start()
        # a later item is computed, proving the worker went past the cancelled batch
        return await outcome(b.submit(q, row(7.0), 30))

    r = asyncio.run(main())
    np.testing.assert_array_equal(r.outputs["y"], row(7.0)["x"] * 2)
    assert fn.seen() == [7.0]


# ---------------------------------------------------------------------------------------- (g)


@pytest.mark.parametrize("pad", [False, True])
def test_backend_failure_fails_only_the_poisoned_item(make, pad):
    def poison(rows):
        return ValueError("poisoned row") if (rows["x"] == -1).any() else None

    fn = FakeFn(fail=poison)
    metrics = Metrics()
    b, q = make(fn, max_batch_size=3, max_delay_s=0.01, pad=pad, metrics=metrics, labels=["g"])

    async def main():
        futs = [b.submit(q, row(v), 30) for v in (1.0, -1.0, 2.0)]
        b.start()
        return [await outcome(f) for f in futs]

    # row(-1.0)["x"] == [-1, -0.75, -0.5]: the poison check sees x == -1
    ok1, bad, ok2 = asyncio.run(main())
    assert fn.shapes[0] == (3, D)  # all three went to the backend together first
    # then bisected: [1] and [-1, 2]; [-1, 2] fails again and splits into [-1] and [2]
    assert len(fn.calls) == 5
    assert [s[0] for s in fn.shapes[1:]] == ([3] * 4 if pad else [1, 2, 1, 1])
    assert isinstance(bad, InferenceFailed)
    assert bad.status == 500
    assert "poisoned row" not in bad.message and "ValueError" not in bad.message  # logged, never sent
    assert "Retry-After" not in bad.headers
    np.testing.assert_array_equal(ok1.outputs["y"], row(1.0)["x"] * 2)
    np.testing.assert_array_equal(ok2.outputs["y"], row(2.0)["x"] * 2)
    assert b.dead is None
    assert b.alive  # an ordinary failure does not stop the worker


def test_worker_survives_a_failing_batch(make):
    calls = {"n": 0}

    def fail_first(rows):
        calls["n"] += 1
        return RuntimeError("transient") if calls["n"] == 1 else None

    fn = FakeFn(fail=fail_first)
    b, q = make(fn, max_batch_size=1)
    b.start()

    async def main():
        return await outcome(b.submit(q, row(1.0), 30)), await outcome(b.submit(q, row(2.0), 30))

    bad, good = asyncio.run(main())
    assert isinstance(bad, InferenceFailed)  # a RuntimeError is deterministic unless it reads as OOM
    np.testing.assert_array_equal(good.outputs["y"], row(2.0)["x"] * 2)


# ---------------------------------------------------------------------------------------- (h)


def test_fatal_error_kills_worker_and_fails_everything(make):
    gate = threading.Event()
    fn = FakeFn(gate=gate, fail=lambda rows: FatalBackendError("sticky CUDA error"))
    other = FakeFn("other")
    metrics = Metrics()
    b, q, q2 = make(fn, other, max_batch_size=1, metrics=metrics, labels=["f", "g"])
    b.start()

    async def main():
        running = b.submit(q, row(1.0), 30)
        await wait_event(fn.entered)
        waiting = [b.submit(q, row(2.0), 30), b.submit(q, row(3.0), 30), b.submit(q2, row(4.0), 30)]
        gate.set()
        got = [await outcome(running)] + [await outcome(f) for f in waiting]
        await asyncio.to_thread(b._threads[0].join, HANG)
        with pytest.raises(Unavailable) as later:
            b.submit(q2, row(5.0), 30)
        return got, later.value

    got, later = asyncio.run(main())
    for e in got:
        assert isinstance(e, Unavailable) and not isinstance(e, BackendFailure)
        assert e.status == 503
        assert "sticky CUDA error" not in e.message and "restarting" in e.message
        assert "Retry-After" in e.headers
    assert b.dead is not None and "sticky CUDA error" in b.dead
    assert not b._threads[0].is_alive()
    assert later.status == 503 and "fatal" in later.message
    assert fn.seen() == [1.0]  # nothing else reached the backend
    assert other.calls == []
    assert gauge(metrics, "f") == 0 and gauge(metrics, "g") == 0


# ---------------------------------------------------------------------------------------- (i)


def test_oldest_head_first_across_queues(make):
    log: list[str] = []
    fa, fb = FakeFn("a", log=log), FakeFn("b", log=log)
    b, qa, qb = make(fa, fb, max_batch_size=1, max_delay_s=0.0)

    async def main():
        futs = []
        for q in (qb, qa, qa, qb, qa):
            futs.append(b.submit(q, row(float(len(futs))), 30))
            await asyncio.sleep(0.002)  # strictly increasing enqueue times
        b.start()
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    results = asyncio.run(main())
    assert log == ["b", "a", "a", "b", "a"]  # submit order, not queue order
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)


def test_older_queue_head_wins_over_a_full_newer_queue(make):
    log: list[str] = []
    fa, fb = FakeFn("a", log=log), FakeFn("b", log=log)
    b, qa, qb = make(fa, fb, max_batch_size=2, max_delay_s=0.0)

    async def main():
        futs = [b.submit(qb, row(0.0), 30)]
        await asyncio.sleep(0.002)
        futs += [b.submit(qa, row(1.0), 30), b.submit(qa, row(2.0), 30)]
        b.start()
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    asyncio.run(main())
    assert log == ["b", "a"]
    assert fb.shapes == [(1, D)] and fa.shapes == [(2, D)]


# ---------------------------------------------------------------------------------------- (j)


def test_queue_depth_gauge_returns_to_zero(make):
    gate = threading.Event()
    fn = FakeFn(gate=gate)
    metrics = Metrics()
    b, q = make(fn, max_batch_size=1, metrics=metrics, labels=["depth"])
    b.start()

    async def main():
        futs = [b.submit(q, row(0.0), 30)]
        await wait_event(fn.entered)
        assert gauge(metrics, "depth") == 0  # the running item left the queue
        futs += [b.submit(q, row(float(i)), 30) for i in range(1, 4)]
        assert gauge(metrics, "depth") == 3
        assert b.depth() == 3 and b.depth(q) == 3
        gate.set()
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    asyncio.run(main())
    assert gauge(metrics, "depth") == 0
    assert b.depth() == 0
    text = generate_latest(metrics.registry).decode()
    assert 'softmoe_queue_depth{model="depth"} 0.0' in text
    assert metrics.batches.labels("depth")._value.get() == 4


def test_queue_depth_zero_after_deadline_and_cancel(make):
    gate = threading.Event()
    fn = FakeFn(gate=gate)
    metrics = Metrics()
    b, q = make(fn, max_batch_size=1, metrics=metrics, labels=["dc"])
    b.start()

    async def main():
        first = b.submit(q, row(0.0), 30)
        await wait_event(fn.entered)
        late = b.submit(q, row(1.0), 0.01)
        gone = b.submit(q, row(2.0), 30)
        gone.cancel()
        assert gauge(metrics, "dc") == 2
        await asyncio.sleep(0.05)
        gate.set()
        return await outcome(first), await outcome(late)

    first, late = asyncio.run(main())
    assert isinstance(first, Result) and isinstance(late, DeadlineExceeded)
    b.stop(timeout=HANG)
    assert gauge(metrics, "dc") == 0


# ---------------------------------------------------------------------------------------- (k)


def test_stop_finishes_queued_items(make):
    # The delay (60 s) would hold a partial batch; stop() must flush it instead of waiting.
    fn = FakeFn()
    b, q = make(fn, max_batch_size=8, max_delay_s=60.0)

    async def main():
        futs = [b.submit(q, row(float(i)), 120) for i in range(3)]
        b.start()
        await asyncio.to_thread(b.stop, HANG)
        alive = b._threads[0].is_alive()
        with pytest.raises(Unavailable) as after:
            b.submit(q, row(9.0), 30)
        return alive, after.value, await asyncio.wait_for(asyncio.gather(*futs), HANG)

    alive, after, results = asyncio.run(main())
    assert not alive
    assert after.status == 503
    assert fn.seen() == [0.0, 1.0, 2.0]
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)


def test_stop_while_busy_finishes_the_rest(make):
    gate = threading.Event()
    fn = FakeFn(gate=gate)
    b, q = make(fn, max_batch_size=2, max_delay_s=60.0)
    b.start()

    async def main():
        futs = [b.submit(q, row(0.0), 120), b.submit(q, row(1.0), 120)]  # full: runs now
        await wait_event(fn.entered)
        futs += [b.submit(q, row(float(i)), 120) for i in range(2, 5)]  # 3 queued, 1 partial batch
        stopper = asyncio.ensure_future(asyncio.to_thread(b.stop, HANG))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.wait_for(stopper, HANG)
        return await asyncio.wait_for(asyncio.gather(*futs), HANG)

    results = asyncio.run(main())
    assert not b._threads[0].is_alive()
    assert fn.shapes == [(2, D), (2, D), (1, D)]
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.outputs["y"], row(float(i))["x"] * 2)


def test_backend_returning_too_few_rows_fails_its_items_and_keeps_the_worker():
    """Regression: an error while splitting results must not kill the worker or strand futures."""

    async def main():
        calls = []

        def short(rows):
            calls.append(len(rows["x"]))
            return {"y": rows["x"][:1]} if len(calls) == 1 else {"y": rows["x"] * 2}

        b = Batcher()
        q = b.add_queue(ModelQueue("m/f", "m", short, max_batch_size=2, max_delay_s=0.01, max_queue=8, pad=False))
        futs = [b.submit(q, {"x": np.full(3, float(i), np.float32)}, 30) for i in range(2)]
        b.start()
        try:
            outcomes = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
            later = await asyncio.wait_for(b.submit(q, {"x": np.ones(3, np.float32)}, 30), 10)
        finally:
            b.stop()
        return outcomes, later, b.dead, calls

    outcomes, later, dead, calls = asyncio.run(main())
    # The failed call is retried item by item; both items then succeed on the healthy backend.
    assert calls[:3] == [2, 1, 1]  # the failed call of 2 was retried item by item
    assert all(not isinstance(o, BaseException) for o in outcomes)
    assert np.array_equal(later.outputs["y"], np.full(3, 2.0, np.float32))
    assert dead is None


def test_between_waits_for_the_call_in_progress_and_no_call_starts_beside_it(make):
    """``Batcher.between`` (a new version's warm-up calls between the served batches): it waits for
    the running call, and with two workers free no item starts until it returns; then they do."""
    order: list[str] = []
    gate = threading.Event()
    fn = FakeFn(gate=gate, log=order)
    b, q = make(fn, max_batch_size=1, workers=2)
    b.start()
    inside, release = threading.Event(), threading.Event()

    def warm() -> str:
        order.append("warm")
        inside.set()
        assert release.wait(HANG)
        return "warmed"

    async def main():
        first = b.submit(q, row(1.0), HANG)
        await wait_event(fn.entered)
        got: list[str] = []
        thread = threading.Thread(target=lambda: got.append(b.between(warm)))
        thread.start()
        assert not inside.wait(0.2), "between ran beside a call in progress"
        gate.set()
        await outcome(first)
        await wait_event(inside)
        fn.entered.clear()
        second = b.submit(q, row(2.0), HANG)
        assert not fn.entered.wait(0.2), "a call started beside between's"
        release.set()
        thread.join(HANG)
        assert got == ["warmed"]
        return await outcome(second)

    result = asyncio.run(main())
    np.testing.assert_array_equal(result.outputs["y"], row(2.0)["x"] * 2)
    assert order == ["fn", "warm", "fn"]
