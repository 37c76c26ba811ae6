"""Start-up, after a model is loaded and its queues attached: every batch shape it will run warmed,
then the proofs that decide how it is served, each on this machine and backend, on random rows:
the padded shapes bitwise equal to the maximal one (strict determinism), whether the routing graph
may stand in for the plain one (sampled statistics, wide lone calls) and whether running batches
beside each other pays, and that concurrent batches give the outputs of calls alone. A proof that
fails narrows how the model is served, or stops the start-up (``ModelLoadError``)."""

from __future__ import annotations

import threading
import time

import numpy as np

from .backends.base import ROUTING, all_functions
from .errors import ModelLoadError
from .registry import ServedModel, backend_threads, total_threads, wide_lone
from .settings import Settings


def warmup(model: ServedModel, settings: Settings, log=print) -> None:
    """Every batch shape the server will run: the proven padded shapes (strict) or 1..max (loose)."""
    if not settings.warmup:
        return
    if settings.strict_determinism:
        model.backend.warmup([settings.max_batch_size])
        if settings.proven_shapes:
            prove_shapes(model, settings.max_batch_size, log)
    else:
        model.backend.warmup(sorted({1, 2, settings.max_batch_size}))
    prove_routing(model, settings, log)
    check_concurrent_batches(model, settings, log)


def check_concurrent_batches(model: ServedModel, settings: Settings, log=print, seed: int = 2) -> None:
    """With ``--concurrent-batches`` N > 1: every function's outputs from N calls running at once
    on the one backend, each with its own random rows, are bitwise equal to the same calls run
    alone, at every shape its queue runs (strict: the proven shapes; loose: the warmed sizes).
    Under ``--wide-lone-batches`` only the functions that run beside others are checked (the rest
    always run alone).

    Raises:
        ModelLoadError: a difference (the server does not start: an answer must not depend on
            what runs beside it).
    """
    n = settings.concurrent_batches
    if n == 1:
        return
    rng = np.random.default_rng(seed)
    checked = []
    beside = getattr(model.backend, "narrow", set()) if wide_lone(settings) else None
    for fn, spec in all_functions(model.backend).items():
        state = model.routing
        if beside is not None and (fn not in beside or (state is not None and state.plain == fn and state.lone
                                                         and state.shared and not state.beside)):
            continue  # always runs alone
        queue = model.queues.get(fn)
        sizes = list(queue.shapes) if settings.strict_determinism and queue is not None \
            else sorted({1, 2, settings.max_batch_size})
        for size in sizes:
            calls = [random_rows(spec, size, rng, model.vocab_size) for _ in range(n)]
            alone = [model.backend.run(fn, rows) for rows in calls]
            try:
                together, _ = run_together(n, lambda i: model.backend.run(fn, calls[i]))
            except Exception as failed:
                raise ModelLoadError(f"{model.name}/{fn}: {n} concurrent calls at batch {size} failed "
                                     f"({type(failed).__name__}: {failed}); use --concurrent-batches 1") from failed
            if any(any(not np.array_equal(got[k], want[k]) for k in want) for got, want in zip(together, alone)):
                raise ModelLoadError(
                    f"{model.name}/{fn}: {n} concurrent calls at batch {size} gave outputs that differ from the same "
                    f"calls alone on this backend; use --concurrent-batches 1")
        checked.append(fn)
    if checked:
        log(f"{model.name}: {n} concurrent batches give outputs bitwise equal to calls alone ({', '.join(checked)})")
    else:
        log(f"{model.name}: every call runs alone, with every intra-op thread (--wide-lone-batches: none of its "
            f"functions runs beside others: each has no routing graph, or start-up timed running beside as not paying)")


def run_together(n: int, call) -> tuple[list, float]:
    """``call(i)`` for i in 0..n-1, on n threads released at once (call 0 on this one): the results
    and the seconds from the release until the last returned. A call that raised is raised here,
    in the caller's thread, after every call has ended."""
    out: list = [None] * n
    failed: list[BaseException] = []
    gate = threading.Barrier(n)
    started = [0.0]

    def one(i: int) -> None:
        try:
            gate.wait(60)
            if i == 0:
                started[0] = time.perf_counter()
            out[i] = call(i)
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            failed.append(e)

    threads = [threading.Thread(target=one, args=(i,), name=f"softmoe-together-{i}") for i in range(1, n)]
    for t in threads:
        t.start()
    one(0)
    for t in threads:
        t.join()
    if failed:
        raise failed[0]
    return out, time.perf_counter() - started[0]


def random_rows(spec, size: int, rng: np.random.Generator, vocab_size: int | None) -> dict[str, np.ndarray]:
    """``size`` random rows of a function's inputs: every byte value for uint8 pixels, token ids
    below the vocabulary for integer inputs, uniform in [-1, 1) otherwise."""
    rows = {}
    for s in spec.inputs:
        shape = (size, *s.shape)
        if s.dtype == np.uint8:
            rows[s.name] = rng.integers(0, 256, shape).astype(s.dtype)
        elif np.issubdtype(s.dtype, np.integer):
            rows[s.name] = rng.integers(0, vocab_size or 2, shape).astype(s.dtype)
        else:
            rows[s.name] = rng.uniform(-1, 1, shape).astype(s.dtype)
    return rows


def prove_routing(model: ServedModel, settings: Settings, log=print, seed: int = 1) -> bool:
    """Whether a sampled call may run the routing graph alone: its copies of the plain function's
    outputs bitwise equal to the plain function's own, on random rows at every shape the plain
    queue runs (strict: its proven shapes; loose: the warmed sizes). Otherwise a sampled call runs
    both graphs, and an image's answer never depends on whether its call was sampled.

    Under ``--wide-lone-batches`` the same proof lets a call that runs alone run the routing graph,
    with every thread (the plain graph's session has a share); without it, every call runs beside
    the others on the plain graph's session."""
    state = model.routing
    if state is None or not (state.sample or state.lone):
        return False
    spec = model.backend.functions[state.plain]
    queue = model.queues.get(state.plain)
    sizes = list(queue.shapes) if settings.strict_determinism and queue is not None \
        else sorted({1, 2, settings.max_batch_size})
    rng = np.random.default_rng(seed)
    for size in sizes:
        rows = random_rows(spec, size, rng, model.vocab_size)
        want = model.backend.run(state.plain, rows)
        got = model.backend.run(ROUTING, rows)
        if any(not np.array_equal(got[k], v) for k, v in want.items()):
            state.shared = False
            why = f"the routing graph's {state.plain} outputs differ from the plain graph's at batch {size}"
            if state.sample:
                log(f"{model.name}: routing statistics from 1 in {state.sample} {state.plain} calls, by a second call "
                    f"({why})")
            if state.lone:
                log(f"{model.name}: no wide lone calls: every {state.plain} call runs beside the others, with "
                    f"{backend_threads(settings)} intra-op threads ({why})")
            return False
    state.shared = True
    if state.lone:
        state.beside = _beside_pays(model, settings, sizes[-1], rng, log)
    if state.sample:
        log(f"{model.name}: routing statistics from 1 in {state.sample} {state.plain} calls, by the routing graph "
            f"alone (its outputs proven bitwise equal to the plain graph's at {sizes})")
    if state.lone and state.beside:
        log(f"{model.name}: a {state.plain} call that runs alone runs the routing graph with {total_threads(settings)} "
            f"intra-op threads, beside others the plain graph with {backend_threads(settings)} (outputs proven "
            f"bitwise equal at {sizes})")
    return True


# --wide-lone-batches: full batches run beside each other only where start-up measures that this
# serves at least this much more than running them alone, one after the other. soft-s16-e128 on 2
# CPUs: batch 8, 1.03-1.14x in bare sessions (1.07x served); batch 32, 1.00-1.01x, where two threads
# already scale well, and where two batches beside each other also hold all of 64 clients' images,
# so none is decoded ahead of the model (served end to end: 0.83-0.85x the raw backend, against
# 0.93 alone). Below it every call runs alone, as with one worker.
BESIDE_MIN_GAIN = 1.04
# A light model's call is shorter than what serving one around it costs, and calls beside each other
# only split its batches (digits, batch 32: 3 ms a call; served beside, 0.93x the images/s).
BESIDE_MIN_MS = 20.0


def _beside_pays(model: ServedModel, settings: Settings, size: int, rng: np.random.Generator, log) -> bool:
    """Whether full batches of the plain function should run beside each other: the best of
    three full batches alone on the routing graph's session (every thread) against the best of three
    rounds of N at once on the plain graph's (1/N of them each). Too light (``BESIDE_MIN_MS``) or
    too small a gain (``BESIDE_MIN_GAIN``): every call alone. ``--wide-lone-beside always|never``
    decides without measuring."""
    state, n = model.routing, settings.concurrent_batches
    if settings.wide_lone_beside != "auto":
        log(f"{model.name}: full {state.plain} batches at load run "
            f"{'beside each other' if settings.wide_lone_beside == 'always' else 'one at a time, alone'} "
            f"(--wide-lone-beside {settings.wide_lone_beside})")
        return settings.wide_lone_beside == "always"
    spec = model.backend.functions[state.plain]
    rows = random_rows(spec, size, rng, model.vocab_size)
    threads = total_threads(settings)

    def alone() -> float:
        start = time.perf_counter()
        model.backend.run(ROUTING, rows)
        return time.perf_counter() - start

    def beside() -> float:
        try:
            return run_together(n, lambda i: model.backend.run(state.plain, rows))[1]
        except Exception as e:  # a failure must not read as a fast call
            raise ModelLoadError(f"{model.name}/{state.plain}: {n} batches of {size} beside each other failed "
                                 f"({type(e).__name__}: {e}); use --concurrent-batches 1") from e

    one_ms = min(alone() for _ in range(2)) * 1000
    if one_ms < BESIDE_MIN_MS:
        log(f"{model.name}: every {state.plain} call runs alone, on the routing graph with {threads} intra-op "
            f"threads (a batch of {size} takes {one_ms:.1f} ms, under {BESIDE_MIN_MS:g})")
        return False
    one_ms = min([one_ms] + [alone() * 1000 for _ in range(1)])
    n_ms = min(beside() for _ in range(3)) * 1000
    gain = n * one_ms / n_ms
    if gain < BESIDE_MIN_GAIN:
        log(f"{model.name}: every {state.plain} call runs alone, on the routing graph with {threads} intra-op threads "
            f"({n} batches of {size} beside each other serve {gain:.2f}x the images/s of one at a time, under "
            f"{BESIDE_MIN_GAIN})")
        return False
    log(f"{model.name}: full {state.plain} batches run beside each other at load ({n} batches of {size} at once serve "
        f"{gain:.2f}x the images/s of one at a time: {n_ms:.0f} vs {one_ms:.0f} ms each)")
    return True


def candidate_shapes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch_size``: the smaller padded shapes worth proving."""
    out, s = [], 1
    while s < max_batch_size:
        out.append(s)
        s *= 2
    return out


def prove_shapes(model: ServedModel, max_batch_size: int, log=print, seed: int = 0) -> dict[str, tuple[int, ...]]:
    """Prove, on this machine and backend, which smaller padded shapes are bitwise equal to the maximal one.

    For each model function: ``max_batch_size`` random rows are run at the maximal shape (the
    reference); then, for each candidate shape ``s``, the same rows in consecutive calls of ``s``
    rows (the last one zero-padded as the batcher pads), so every slot position of ``s`` carries a
    different random row. ``s`` is proven when every row's every output is bitwise equal to the
    reference row. Unproven shapes are never used; the queue falls back to the maximal shape.
    This also warms every shape it proves.
    """
    rng = np.random.default_rng(seed)
    proven: dict[str, tuple[int, ...]] = {}
    for fn, spec in model.backend.functions.items():
        rows = random_rows(spec, max_batch_size, rng, model.vocab_size)
        reference = model.backend.run(fn, rows)
        good = []
        for size in candidate_shapes(max_batch_size):
            same = True
            for start in range(0, max_batch_size, size):
                chunk = {}
                for name, arr in rows.items():
                    part = np.zeros((size, *arr.shape[1:]), dtype=arr.dtype)
                    got = arr[start:start + size]
                    part[:len(got)] = got
                    chunk[name] = part
                out = model.backend.run(fn, chunk)
                n = min(size, max_batch_size - start)
                if any(not np.array_equal(out[k][:n], reference[k][start:start + n]) for k in reference):
                    same = False
                    break
            if same:
                good.append(size)
        shapes = tuple(good) + (max_batch_size,)
        proven[fn] = shapes
        queue = model.queues.get(fn)
        if queue is not None:
            queue.shapes = shapes
        rejected = sorted(set(candidate_shapes(max_batch_size)) - set(good))
        log(f"{model.name}/{fn}: padded shapes proven bitwise equal to {max_batch_size}: {list(shapes)}"
            + (f"; not used (outputs differ): {rejected}" if rejected else ""))
    model.proven_shapes = proven
    return proven
