"""The job engine's parts around the model (server/jobs/runner.py): the decode pool survives a
decoder process that dies, and the progress report is a bar on a terminal and lines elsewhere."""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import time

import numpy as np

from helpers import datasets
from server.jobs.runner import DecodePool, Progress
from server.settings import Settings
from softmoe_models.preprocess import PreprocessConfig


def test_a_dead_decoder_process_fails_nothing_but_its_own_entry(tmp_path):
    """A worker killed mid-chunk breaks the pool: the chunk is retried an entry at a time in a new
    pool, and every row equals a run that was not disturbed."""
    from sklearn.datasets import load_sample_image
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(load_sample_image("china.jpg")).resize((2560, 1920)).save(buf, "JPEG", quality=90)
    photo, junk = (None, buf.getvalue()), (None, b"not an image")
    cfg = PreprocessConfig(image_size=32)
    pool = DecodePool(Settings(), workers=1)
    pool.use(cfg, False)
    try:
        (row, why), (none, reason) = asyncio.run(pool.prepare([photo, junk]))  # undisturbed
        assert why is None and none is None and reason

        async def disturbed():
            task = asyncio.ensure_future(pool.prepare([photo] * 150 + [junk]))  # seconds of decoding
            await asyncio.sleep(0.5)
            assert not task.done()
            for pid in list(pool.pool._processes):
                os.kill(pid, signal.SIGKILL)
            return await task

        first = pool.pool
        got = asyncio.run(disturbed())
        assert pool.pool is not first  # a new pool took over
    finally:
        pool.close()
    assert len(got) == 151 and got[-1] == (None, reason)
    for r, w in got[:-1]:
        assert w is None and np.array_equal(r["pixel_values"], row["pixel_values"])


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_off_a_terminal_and_a_bar_on_one(monkeypatch):
    plain = io.StringIO()
    p = Progress("embed", 10, stream=plain)
    p.update(4, 1)
    p.close()
    line = plain.getvalue().strip().splitlines()[-1]
    assert line.startswith("embed: 4/10 images,") and "img/s" in line and "ETA" in line and "1 errors" in line
    ticks = iter([0.0, 11.0, 22.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    timed = io.StringIO()
    p = Progress("eval", None, stream=timed)
    p.update(2, 0)  # 11 s after the start: a line
    p.update(2, 0)  # 11.5 s after that one: another
    assert len(timed.getvalue().splitlines()) == 2 and "4 images" in timed.getvalue()
    monkeypatch.undo()
    tty = _Tty()
    p = Progress("embed", 10, stream=tty)
    p.update(5, 2)
    p.close()
    assert "errors=2" in tty.getvalue() and "img/s" in tty.getvalue()


def test_decoders_that_cannot_run_stop_the_job_with_one_line(tmp_path):
    """A script that runs a job without the ``__main__`` guard: every decode process re-runs the
    script and dies at start. The job does not report every file as a decoder crash: it stops."""
    import subprocess
    import sys

    data = datasets.build(tmp_path / "data", n=12)
    script = tmp_path / "unguarded.py"
    script.write_text("from server.main import main\n"
                      f"main(['embed', {datasets.DIGITS!r}, {str(data.folder)!r}, '--out', {str(tmp_path / 'out')!r}])\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]  # the children's own
    assert len(errors) == 1, done.stderr[-2000:]  # tracebacks come first; the job's one line is the end
    assert re.match(r"error: the decode processes died on \d+ files in a row", errors[0])
    assert not (tmp_path / "out" / "_shards.jsonl").exists()
