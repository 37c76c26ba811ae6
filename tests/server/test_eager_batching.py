"""Eager batching (``--eager-batching``, the default): an idle worker runs what is queued at once
when no admitted request is still decoding for that queue; the engine process counts what the
front ends will still send. Same fake backend and fixture as test_batcher.py."""

from __future__ import annotations

import asyncio

import pytest

from helpers.batching import D, HANG, FakeFn, make, row  # noqa: F401 - make: a fixture


def _eager(make, pad: bool = False):
    """A started batcher with one eager queue whose window (60 s) never runs out in a test."""
    fn = FakeFn()
    b, q = make(fn, max_batch_size=4, max_delay_s=60.0, pad=pad, eager=True)
    b.start()
    return fn, b, q


@pytest.mark.parametrize("pad", [False, True])
def test_eager_lone_item_runs_at_once(make, pad):
    """Nothing else admitted: an idle worker does not sit out a 60 s max_delay."""
    fn, b, q = _eager(make, pad)

    async def main():
        return await asyncio.wait_for(b.submit(q, row(1.0), 120), HANG)

    asyncio.run(main())
    assert b.calls == 1 and fn.shapes[0][0] == (4 if pad else 1)


def test_eager_waits_for_admitted_items_still_decoding(make):
    """Three requests admitted (places reserved); the first to finish decoding waits for the others."""
    fn, b, q = _eager(make)

    async def main():
        b.reserve(q, 3)
        first = b.submit(q, row(0.0), 120, reserved=True)
        await asyncio.sleep(0.3)  # decoding the others: the first must not run alone meanwhile
        assert b.calls == 0 and not first.done()
        rest = [b.submit(q, row(float(i)), 120, reserved=True) for i in (1, 2)]
        return await asyncio.wait_for(asyncio.gather(first, *rest), HANG)

    asyncio.run(main())
    assert fn.shapes == [(3, D)] and b.calls == 1


def test_eager_released_places_let_the_worker_go(make):
    """A request that fails before submitting gives its places back; what is queued then runs."""
    fn, b, q = _eager(make)

    async def main():
        b.reserve(q, 2)
        fut = b.submit(q, row(0.0), 120, reserved=True)
        await asyncio.sleep(0.2)
        assert not fut.done()
        b.release(q, 1)
        return await asyncio.wait_for(fut, HANG)

    asyncio.run(main())
    assert fn.shapes == [(1, D)]


def test_without_eager_a_lone_item_waits_for_max_delay(make):
    """The classic policy, kept for --no-eager-batching: a lone item waits for its window (60 s
    here) or a full batch, whichever comes first."""
    fn = FakeFn()
    b, q = make(fn, max_batch_size=2, max_delay_s=60.0)
    b.start()

    async def main():
        first = b.submit(q, row(0.0), 120)
        await asyncio.sleep(0.3)
        assert b.calls == 0 and not first.done()
        return await asyncio.wait_for(asyncio.gather(first, b.submit(q, row(1.0), 120)), HANG)

    asyncio.run(main())
    assert fn.shapes == [(2, D)]


def test_engine_counts_what_the_front_ends_will_still_send():
    """--frontend-workers: the engine's eager queues read the front ends' reserved places and items
    in transit from the shared admission table."""
    import multiprocessing

    from server.workers.shm import AdmissionTable

    table = AdmissionTable.create(multiprocessing.Lock(), queues=2, frontends=2)
    try:
        assert table.coming(0) == table.coming(1) == 0
        table.reserved[0, 1] = 2
        table.sent[0, 0] = 1
        table.queued[1] = 5  # already in the engine's queue: not coming
        assert (table.coming(0), table.coming(1)) == (3, 0)
    finally:
        table.close(unlink=True)
