"""What a first start's ONNX export leaves in the server process: exported in-process vs in a child.

    python -m loadtests.export_memory [--model PKG] [--work DIR]

For each way, a fresh process does what `softmoe serve --backend onnxruntime` does at a first
start (``exported_files`` into an empty cache, then the backend's sessions) and reports its
resident memory after the export and after the sessions; the two ways run one after the other,
each in its own process, each with its own empty cache (deleted afterwards). One JSON line:
``export_child_rss_mb``, ``export_inprocess_rss_mb`` (after the sessions: what the server keeps
serving with), their ratio, and the seconds each first start took. Default model: the shipped
digits (small enough that the server exports it in-process; the child is forced here). The
figure that matters is a large package, e.g. soft-s16-e128 (``softmoe init soft-s16-e128 DIR``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import gc, json, sys
from pathlib import Path
import server.backends.onnxruntime_backend as ob
def rss():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]) // 1024
package, cache, way = sys.argv[1:4]
ob.EXPORT_IN_CHILD_BYTES = 0 if way == "child" else 1 << 62
files = ob.exported_files(Path(package), cache, "fp32", log=lambda m: None)
gc.collect()
exported = rss()
backend = ob.OnnxRuntimeBackend(files, max_batch_size=8, weights=Path(package) / "model.safetensors")
print(json.dumps({"after_export_mb": exported, "after_sessions_mb": rss()}))
"""


def first_start(package: Path, work: Path, way: str) -> dict:
    cache = Path(tempfile.mkdtemp(prefix=f"export-memory-{way}-", dir=work))
    try:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", _CHILD, str(package), str(cache), way], cwd=ROOT,
                           capture_output=True, text=True, check=True)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        out["seconds"] = round(time.perf_counter() - t0, 1)
        return out
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run(package: Path, work: Path, log=print) -> dict:
    result = {way: first_start(package, work, way) for way in ("child", "inprocess")}
    for way, r in result.items():
        log(f"export {way}: {r['after_export_mb']} MB after the export, {r['after_sessions_mb']} MB serving, {r['seconds']} s")
    child, inproc = result["child"], result["inprocess"]
    return {"export_model": package.name,
            "export_child_rss_mb": child["after_sessions_mb"], "export_inprocess_rss_mb": inproc["after_sessions_mb"],
            "export_child_after_export_mb": child["after_export_mb"],
            "export_inprocess_after_export_mb": inproc["after_export_mb"],
            "export_inprocess_over_child_rss": round(inproc["after_sessions_mb"] / child["after_sessions_mb"], 3),
            "export_child_s": child["seconds"], "export_inprocess_s": inproc["seconds"]}


def main(argv: list[str] | None = None) -> int:
    from server.engine.defaults import SHIPPED

    parser = argparse.ArgumentParser(description="server memory after a first-start export, in-process vs child")
    parser.add_argument("--model", type=Path, default=SHIPPED / "digits", help="a model package directory")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()), help="where the temporary caches go")
    args = parser.parse_args(argv)
    out = run(args.model, args.work, log=lambda m: print(m, file=sys.stderr, flush=True))
    out["command"] = f"python -m loadtests.export_memory --model {args.model}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
