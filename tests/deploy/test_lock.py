"""The hash-locked requirements (requirements/*.lock) and how the images and `make setup` use them.

- every requirement in every lock is pinned ``==`` and carries at least one ``--hash=sha256:``;
- the GPU image's packages (gpu.lock, tensorrt.lock when generated, tensorrt.in) use one CUDA
  major: nvidia-*-cuXX suffixes, the unsuffixed CUDA toolkit wheels' versions, torch +cuXXX local
  versions, the CUDA build of PyPI's default torch / onnxruntime-gpu (table below, from
  docs/gpu-stack.md), tensorrt-cuXX;
- the CPU image's and the dev venv's locks hold no CUDA package and the CPU build of torch;
- versions shared by the locks agree, constraints.txt is dev.lock without hashes, and every
  dependency pyproject.toml declares is locked (a new dependency needs `make lock`);
- the Dockerfile installs only from the locks, with --require-hashes, and `make setup` too.
The checker itself is tested on a mixed lock it must reject.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
LOCKS = ["dev.lock", "cpu.lock", "gpu.lock"] + (["tensorrt.lock"] if (REQ / "tensorrt.lock").exists() else [])

# CUDA major of the default (no local version) Linux x86_64 wheels on PyPI, read from their
# metadata (torch: Requires-Dist cuda-toolkit==13.0.3, nvidia-cudnn-cu13; onnxruntime-gpu:
# build_and_package_info.cuda_version, the sonames its CUDA provider needs). docs/gpu-stack.md
# records how; a version not listed fails, so a bump updates this table and the matrix together.
PYPI_DEFAULT_CUDA = {
    "torch": {"2.13.0": 13},
    "onnxruntime-gpu": {"1.31.1": 13},
}
# Unsuffixed wheels whose major version is the CUDA major (CUDA 13 dropped the -cu13 suffix for
# the toolkit wheels; cuFFT, cuRAND, cuSOLVER, cuSPARSE number their versions differently).
CUDA_VERSIONED = {"cuda-toolkit", "cuda-bindings", "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-cuda-nvrtc",
                  "nvidia-cuda-cupti", "nvidia-nvjitlink", "nvidia-nvtx", "nvidia-cuda-nvcc", "nvidia-cuda-crt",
                  "nvidia-nvvm"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# name[extras]==version[; marker] --hash=sha256:... (one or more)
REQUIREMENT = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;]+)((?:\s*;[^-]*)?)"
                         r"((?:\s+--hash=sha256:[0-9a-f]{64})*)")


def parse_lock(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) from a pip requirements file with hashes; raises on anything else."""
    out: dict[str, tuple[str, list[str]]] = {}
    # Join continuation lines; drop comments.
    logical = re.sub(r"\\\n\s*", " ", text)
    for line in logical.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            raise ValueError(f"option line in a lock: {line!r}")
        m = REQUIREMENT.fullmatch(line)
        if not m:
            raise ValueError(f"not pinned with == and --hash=sha256: {line!r}")
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", m.group(5))
        if not hashes:
            raise ValueError(f"no hash: {line!r}")
        out[normalize(m.group(1))] = (m.group(3), hashes)
    return out


def lock(name: str) -> dict[str, tuple[str, list[str]]]:
    return parse_lock((REQ / name).read_text())


def cuda_majors(pins: dict[str, str]) -> dict[int, list[str]]:
    """CUDA major -> the pins that imply it. Raises on a GPU package whose CUDA build is unknown."""
    majors: dict[int, list[str]] = {}

    def add(major: int, why: str) -> None:
        majors.setdefault(major, []).append(why)

    for name, version in pins.items():
        pin = f"{name}=={version}"
        if m := re.search(r"-cu(\d+)(?:-|$)", name):
            add(int(m.group(1)), pin)
        elif name in CUDA_VERSIONED:
            add(int(version.split(".")[0]), pin)
        elif name in ("torch", "onnxruntime-gpu", "onnxruntime"):
            local = version.partition("+")[2]
            if m := re.fullmatch(r"cu(\d+)(\d)", local):
                add(int(m.group(1)), pin)
            elif local == "cpu" or name == "onnxruntime":
                continue
            elif version in PYPI_DEFAULT_CUDA.get(name, {}):
                add(PYPI_DEFAULT_CUDA[name][version], f"{pin} (PyPI's default build)")
            else:
                raise AssertionError(f"{pin}: which CUDA is this build for? Add it to PYPI_DEFAULT_CUDA "
                                     "after checking (docs/gpu-stack.md)")
        elif name in ("tensorrt", "tensorrt-libs", "tensorrt-bindings"):
            raise AssertionError(f"{pin}: unsuffixed TensorRT picks its CUDA itself: pin tensorrt-cuXX")
    return majors


def in_pins(path: Path) -> dict[str, str]:
    """The `name==version` pins of a .in file (other lines ignored)."""
    out = {}
    for line in path.read_text().splitlines():
        if m := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            out[normalize(m.group(1))] = m.group(2)
    return out


# ------------------------------------------------------------------------------------------ the locks

@pytest.mark.parametrize("name", LOCKS)
def test_every_requirement_is_pinned_with_a_hash(name):
    text = (REQ / name).read_text()
    pins = parse_lock(text)
    assert len(pins) > 10, name
    assert "autogenerated by uv" in text and "requirements/compile.sh" in text, "generate with requirements/compile.sh"
    assert "file://" not in text and "/opt/" not in text, "a local path leaked into the lock"


def test_gpu_image_has_one_cuda_major():
    pins = {n: v for n, (v, _) in lock("gpu.lock").items()}
    if "tensorrt.lock" in LOCKS:
        trt = {n: v for n, (v, _) in lock("tensorrt.lock").items()}
        shared = {n for n in trt if n in pins and trt[n] != pins[n]}
        assert not shared, f"tensorrt.lock changes versions of gpu.lock: {shared}"
        pins |= trt
    pins |= in_pins(REQ / "tensorrt.in")  # what tensorrt.lock will hold, generated or not
    majors = cuda_majors(pins)
    assert len(majors) == 1, f"several CUDA majors in the GPU image: {majors}"
    (major,) = majors
    assert major == 13, "docs/gpu-stack.md and the Dockerfile's LD_LIBRARY_PATH (nvidia/cu13) say CUDA 13"
    assert "onnxruntime-gpu" in pins and "onnxruntime" not in pins, "one of onnxruntime, onnxruntime-gpu per venv"
    assert any(n.startswith("nvidia-cudnn-cu") for n in pins), "cuDNN comes from the lock"
    assert any(n.startswith("tensorrt-cu") for n in pins)


@pytest.mark.parametrize("name", ["cpu.lock", "dev.lock"])
def test_cpu_locks_hold_no_cuda(name):
    pins = {n: v for n, (v, _) in lock(name).items()}
    assert pins["torch"].endswith("+cpu"), "the CPU build of torch (a plain torch from PyPI is the CUDA build)"
    gpu = [n for n in pins if n.startswith(("nvidia-", "cuda-", "tensorrt", "onnxruntime-gpu")) or n == "triton"]
    assert not gpu, f"CUDA packages in {name}: {gpu}"
    assert not cuda_majors(pins)


def test_the_checker_catches_mixed_majors():
    mixed = (
        "torch==2.13.0+cu128 \\\n    --hash=sha256:" + "a" * 64 + "\n"
        "nvidia-cudnn-cu12==9.1.0.70 --hash=sha256:" + "b" * 64 + "\n"
        "nvidia-cublas==13.1.1.3 --hash=sha256:" + "c" * 64 + "\n"
        "onnxruntime-gpu==1.31.1 --hash=sha256:" + "d" * 64 + "\n"
        "tensorrt-cu13-libs==10.16.1.11 --hash=sha256:" + "e" * 64 + "\n"
    )
    pins = {n: v for n, (v, _) in parse_lock(mixed).items()}
    majors = cuda_majors(pins)
    assert set(majors) == {12, 13}
    assert "torch==2.13.0+cu128" in majors[12] and "nvidia-cudnn-cu12==9.1.0.70" in majors[12]
    assert {"nvidia-cublas==13.1.1.3", "tensorrt-cu13-libs==10.16.1.11"} <= set(majors[13])
    with pytest.raises(AssertionError, match="unsuffixed TensorRT"):
        cuda_majors({"tensorrt": "10.16.1.11"})
    with pytest.raises(AssertionError, match="which CUDA"):
        cuda_majors({"onnxruntime-gpu": "1.99.0"})
    for bad in ("numpy>=2 --hash=sha256:" + "a" * 64, "numpy==2.4.6", "-e .", "numpy @ https://x/y.whl"):
        with pytest.raises(ValueError):
            parse_lock(bad + "\n")


def test_shared_versions_agree():
    dev, cpu, gpu = (lock(n) for n in ("dev.lock", "cpu.lock", "gpu.lock"))
    for name, (version, _) in cpu.items():
        assert dev.get(name, (None,))[0] == version, f"{name}: cpu.lock {version}, dev.lock {dev.get(name)}"
    for name, (version, _) in gpu.items():
        if name in dev and name not in ("torch", "onnxruntime-gpu"):
            assert dev[name][0] == version, f"{name}: gpu.lock {version}, dev.lock {dev[name][0]}"
    assert cpu["torch"][0].partition("+")[0] == gpu["torch"][0].partition("+")[0], "one torch release"
    assert cpu["onnxruntime"][0] == gpu["onnxruntime-gpu"][0], "one ONNX Runtime release"


def test_constraints_txt_is_dev_lock_without_hashes():
    pins = dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M))
    assert {normalize(k): v for k, v in pins.items()} == {n: v for n, (v, _) in lock("dev.lock").items()}


def test_every_declared_dependency_is_locked():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group(0)) for r in reqs}

    base, extras = names(project["dependencies"]), project["optional-dependencies"]
    for lock_name, extra in (("cpu.lock", "cpu"), ("gpu.lock", "gpu"), ("dev.lock", "dev")):
        missing = (base | names(extras[extra])) - set(lock(lock_name))
        assert not missing, f"{lock_name} lacks {sorted(missing)}: run `make lock`"
    trt = names(extras["tensorrt"]) - set(in_pins(REQ / "tensorrt.in"))
    assert not trt, f"the tensorrt extra names {trt}, tensorrt.in does not"


def test_generator_is_pinned():
    script = (REQ / "compile.sh").read_text()
    version = re.search(r"^UV_VERSION=(\S+)$", script, re.M).group(1)
    dev = re.findall(r'"uv==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert dev == [version], "pyproject's dev extra pins the uv that compile.sh requires"
    assert lock("dev.lock")["uv"][0] == version
    assert "--generate-hashes" in script


# ------------------------------------------------------------------------------------------ who installs them

def dockerfile_runs() -> list[str]:
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("RUN ")]


def test_dockerfile_installs_only_from_the_locks_with_hashes():
    helper = (ROOT / "deploy" / "images" / "pip-install.sh").read_text()
    assert re.search(r"pip install --require-hashes --no-deps --only-binary :all: -r \"\$lock\"", helper)
    runs = dockerfile_runs()
    installed = set(re.findall(r"pip-install /src/requirements/(\S+\.lock)", " ".join(runs)))
    assert installed == {"cpu.lock", "gpu.lock", "tensorrt.lock"}
    for run in runs:
        for cmd in re.findall(r"pip install ([^&;|]*)", run):
            # The project itself: no dependencies, no index (everything came from a lock).
            assert "--no-deps" in cmd and "--no-index" in cmd and cmd.split()[-1] == "/src", cmd
    text = (ROOT / "Dockerfile").read_text()
    for leak in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT", "PIP_TRUSTED_HOST",
                 "http_proxy", "https_proxy", "pip.conf"):
        assert not re.search(rf"^(ARG|ENV)\b.*\b{leak}\b", text, re.M | re.I), f"{leak} would be baked into the image"
    assert "id=pipconf" in text and "id=pipca" in text


def test_make_setup_installs_the_dev_lock_with_hashes():
    make = (ROOT / "Makefile").read_text()
    recipe = make.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "requirements/dev.lock" in recipe.splitlines()[0], "the stamp depends on the lock"
    assert "--require-hashes" in recipe and "-r requirements/dev.lock" in recipe
    assert "--no-deps" in recipe.split("-e .", 1)[0].rsplit("\n", 1)[1], "the project adds no unlocked package"
    assert re.search(r"^image-check:\s*\n\t.*deploy/images/check\.sh", make, re.M)


def test_dockerignore_keeps_the_context_small():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "exclude everything, then let in what the Dockerfile copies"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for heavy in (".venv", ".git", "tests", "runs", "loadtests"):
        assert heavy not in allowed
    copied = set()
    for src in re.findall(r"^COPY (?!--from)(.+) \S+$", (ROOT / "Dockerfile").read_text(), re.M):
        copied |= {s.rstrip("/").rstrip("*") for s in src.split()}
    for src in copied:
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"COPY {src} is not in the context"
