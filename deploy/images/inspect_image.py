"""Inspect the Python stack inside an image: run by deploy/images/check.sh as
``docker run -i --read-only --entrypoint python IMAGE - [--gpu] < inspect_image.py``.

Prints one ``PASS``/``FAIL``/``INFO`` line per check and exits non-zero on a failure:

- ``pip check``: the installed set is consistent; with ``--lock=PATH`` (repeatable), every
  installed distribution is the one the lock(s) name, and every locked one is installed;
- no pip configuration in the image (files or PIP_* variables): the build's settings stayed in it;
- ``--gpu``: every shared library of torch, ONNX Runtime's providers, the NVIDIA wheels and
  TensorRT (when installed) resolves with the image's own LD_LIBRARY_PATH: ``ldd`` reports no
  "not found" except libcuda.so.1, which the NVIDIA driver provides at run time; one CUDA major
  across the installed distributions (nvidia-*, torch's and ONNX Runtime's build info) and the
  ELF files (sonames of libcudart, libcublas, libcublasLt, libnvrtc, libnvJitLink, and what every
  library needs of them).

Only the standard library and the image's own tools (ldd); nothing is written.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

GPU = "--gpu" in sys.argv
SITE = Path(sysconfig.get_paths()["purelib"])
# Provided by the NVIDIA driver (NVIDIA Container Toolkit mounts it), never by an image.
DRIVER_LIBS = {"libcuda.so.1"}
# Optional plugins of the NVIDIA wheels, loaded only for multi-node or storage transports this
# single-GPU server never uses: NVSHMEM's bootstrap/transport plugins (MPI, PMIx, OpenSHMEM, UCX,
# libfabric, InfiniBand mlx5) and cuFile's RDMA plugin (GPUDirect Storage). Their interconnect
# libraries are not in the image; any other unresolved library fails the check.
OPTIONAL_PLUGIN = re.compile(r"^nvidia/.*/(nvshmem_(bootstrap|transport)_\w+\.so\.\d+|libcufile_rdma\.so\.\d+)$")
INTERCONNECT_LIBS = {"libmpi.so.40", "libpmix.so.2", "liboshmem.so.40", "libucs.so.0", "libucp.so.0",
                     "libfabric.so.1", "libmlx5.so.1", "libibverbs.so.1", "librdmacm.so.1"}
# Loaded with dlopen (not DT_NEEDED, so ldd cannot see them): they must be on LD_LIBRARY_PATH.
DLOPENED = ["libcudnn.so.9", "libnvrtc.so.13", "libnvJitLink.so.13", "libcufft.so.12", "libcublasLt.so.13"]
# Sonames whose number is the CUDA major (cuFFT, cuRAND, cuSPARSE... number theirs differently).
CUDA_SONAME = re.compile(r"^lib(cudart|cublas|cublasLt|nvrtc|nvJitLink)\.so\.(\d+)$")
failures = 0


def report(ok: bool, what: str, detail: str = "") -> None:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}", flush=True)


def info(what: str) -> None:
    print(f"INFO {what}", flush=True)


def pip_check() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True,
                         env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    report(out.returncode == 0, "pip check", (out.stdout + out.stderr).strip().splitlines()[0])


def matches_locks(paths: list[str]) -> None:
    """Every installed distribution is in the lock(s) at the locked version, and vice versa."""
    locked: dict[str, str] = {}
    for path in paths:
        for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", Path(path).read_text(), re.M):
            locked[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in md.distributions()}
    installed.pop("softmoe-serve", None)  # the project itself, installed with --no-deps
    extra = sorted(f"{n}=={v}" for n, v in installed.items() if locked.get(n) != v)
    missing = sorted(f"{n}=={v}" for n, v in locked.items() if n not in installed)
    report(not extra and not missing, f"installed packages == {', '.join(Path(p).name for p in paths)}",
           f"not locked: {extra}; not installed: {missing}" if extra or missing else f"{len(installed)} packages")


def no_pip_config() -> None:
    found = [p for p in ("/etc/pip.conf", "/etc/xdg/pip", "/root/.pip", "/root/.config/pip",
                         "/tmp/.config/pip", "/run/secrets/pipconf", "/run/secrets/pipca")
             if os.path.lexists(p)]
    found += [f"${k}" for k in os.environ if k.startswith("PIP_")]
    report(not found, "no pip configuration in the image", ", ".join(found) or "none")


def shared_libraries() -> list[Path]:
    roots = [SITE / "torch" / "lib", SITE / "onnxruntime" / "capi", SITE / "nvidia",
             SITE / "tensorrt_libs", SITE / "tensorrt_bindings"]
    libs = []
    for root in roots:
        if root.is_dir():
            libs += sorted(p for p in root.rglob("*.so*") if p.is_file() and not p.is_symlink()
                           and re.search(r"\.so(\.\d+)*$", p.name))
    return libs


def ldd(lib: Path) -> dict[str, str]:
    """soname -> resolved path or 'not found', as the loader sees it with the image's environment."""
    out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True)
    deps = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\s*(\S+) => (.*?)(?: \(0x[0-9a-f]+\))?$", line)
        if m:
            deps[m.group(1)] = m.group(2).strip()
    return deps


def needed(lib: Path) -> list[str]:
    """DT_NEEDED entries, read from the ELF dynamic section (no binutils in the image)."""
    import struct

    data = lib.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit ELF only
        return []
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    out = []
    for sh in sections:
        if sh[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strtab[4] + val
                out.append(data[start:data.index(b"\0", start)].decode())
    return out


def gpu_checks() -> None:
    info("LD_LIBRARY_PATH=" + os.environ.get("LD_LIBRARY_PATH", ""))
    missing_dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and not os.path.isdir(d)]
    trt = (SITE / "tensorrt_libs").is_dir()
    if missing_dirs:
        # tensorrt_libs is listed for images with TensorRT; nothing else may be missing.
        bad = [d for d in missing_dirs if not (d.endswith("tensorrt_libs") and not trt)]
        report(not bad, "LD_LIBRARY_PATH folders exist", ", ".join(bad) or "tensorrt_libs absent (no TensorRT)")

    libs = shared_libraries()
    unresolved: dict[str, list[str]] = {}
    optional: dict[str, list[str]] = {}
    skipped = []
    majors: dict[int, set[str]] = {}
    for lib in libs:
        rel = str(lib.relative_to(SITE))
        if not trt and lib.name.startswith("libonnxruntime_providers_tensorrt"):
            skipped.append(rel)  # ORT's TensorRT provider needs libnvinfer: only with TensorRT
            continue
        for soname, where in ldd(lib).items():
            if where != "not found" or soname in DRIVER_LIBS:
                continue
            if OPTIONAL_PLUGIN.match(rel) and soname in INTERCONNECT_LIBS:
                optional.setdefault(rel.rpartition("/")[2], []).append(soname)
            else:
                unresolved.setdefault(rel, []).append(soname)
        m = CUDA_SONAME.match(lib.name)
        if m:
            majors.setdefault(int(m.group(2)), set()).add(rel)
        for dep in needed(lib):
            m = CUDA_SONAME.match(dep)
            if m:
                majors.setdefault(int(m.group(2)), set()).add(f"{rel} needs {dep}")
    info(f"{len(libs)} shared libraries under torch/lib, onnxruntime/capi, nvidia/, tensorrt_libs")
    report(not unresolved, "every shared library resolves (ldd; libcuda.so.1 is the driver's)",
           json.dumps(unresolved) if unresolved else f"{len(libs) - len(skipped)} libraries")
    if optional:
        info("optional multi-node/RDMA plugins, their interconnect libraries not installed: "
             + "; ".join(f"{k} ({', '.join(v)})" for k, v in sorted(optional.items())))
    if skipped:
        info(f"not checked without TensorRT: {', '.join(skipped)}")
    path = [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    wanted = DLOPENED + (["libnvinfer.so.10", "libnvonnxparser.so.10"] if trt else [])
    absent = [s for s in wanted if not any((d / s).exists() for d in path)]
    report(not absent, "dlopen()ed libraries on LD_LIBRARY_PATH", ", ".join(absent) or ", ".join(wanted))
    for name in ("onnxruntime/capi/libonnxruntime_providers_cuda.so", "torch/lib/libtorch_cuda.so"):
        report((SITE / name).is_file(), f"{name} present")
    if trt:
        report(any(p.name.startswith("libnvinfer.so") for p in libs), "TensorRT libnvinfer present")

    # Distributions: nvidia-*-cuNN suffixes and the CUDA toolkit wheels' own versions.
    toolkit = {"nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-nvrtc", "nvidia-nvjitlink",
               "nvidia-cuda-runtime-cu12", "nvidia-cublas-cu12", "nvidia-cuda-nvrtc-cu12",
               "nvidia-nvjitlink-cu12", "cuda-toolkit", "cuda-bindings"}
    for d in md.distributions():
        name = d.metadata["Name"].lower().replace("_", "-")
        m = re.search(r"-cu(\d+)(?:-|$)", name)
        if m:
            majors.setdefault(int(m.group(1)), set()).add(f"{name}=={d.version}")
        elif name in toolkit:
            majors.setdefault(int(d.version.split(".")[0]), set()).add(f"{name}=={d.version}")
    import torch

    if torch.version.cuda:
        majors.setdefault(int(torch.version.cuda.split(".")[0]), set()).add(f"torch.version.cuda={torch.version.cuda}")
    try:
        from onnxruntime.capi import build_and_package_info as ort_build

        cuda = getattr(ort_build, "cuda_version", "")
        if cuda:
            majors.setdefault(int(cuda.split(".")[0]), set()).add(f"onnxruntime-gpu cuda_version={cuda}")
        info(f"onnxruntime {ort_build.__version__} ({ort_build.package_name}): CUDA {cuda or '?'}")
    except ImportError:
        report(False, "onnxruntime build info")
    info(f"torch {torch.__version__}: CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    summary = {k: len(v) for k, v in sorted(majors.items())}
    detail = "; ".join(f"CUDA {k}: {sorted(v)[:4]}" for k, v in sorted(majors.items())) if len(majors) > 1 else ""
    report(len(majors) == 1, f"one CUDA major {summary}", detail)


if __name__ == "__main__":
    pip_check()
    locks = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--lock=")]
    if locks:
        matches_locks(locks)
    no_pip_config()
    info(f"python {sys.version.split()[0]}, uid {os.getuid()}, site-packages {SITE}")
    report(os.getuid() != 0, "runs as non-root", f"uid {os.getuid()}")
    if GPU:
        gpu_checks()
    sys.exit(1 if failures else 0)
