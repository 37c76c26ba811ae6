#!/usr/bin/env bash
# `make image-check`: build both images here and check what they promise.
#
#   deploy/images/check.sh              build cpu and gpu (deploy/images/build.sh), then check
#   NO_BUILD=1 deploy/images/check.sh   check the images already tagged
#
# Both images: run as non-root (10001:10001), `pip check`, installed packages == the lock(s),
# no pip configuration (file or PIP_*)
# and none of the build's settings (find-links, the loopback wheel server, secrets) in the
# image's env or history. CPU image: serves the built-in default models with a read-only root
# filesystem (`--read-only --tmpfs /tmp -v <volume>:/cache --cap-drop ALL`) and answers
# /v2/health/ready, with the torch backend and with ONNX Runtime (which exports into /cache).
# GPU image: every shared library of torch, ONNX Runtime's CUDA (and TensorRT) providers, the
# NVIDIA wheels and TensorRT resolves (ldd with the image's LD_LIBRARY_PATH; libcuda.so.1 is the
# driver's, the one allowed "not found"); one CUDA major everywhere; `softmoe --help` and an
# ONNX Runtime (CPU execution provider) server with the read-only root filesystem, since this
# host has no GPU. Sizes of both images are printed. Needs a running Docker engine.
set -euo pipefail
cd "$(dirname "$0")/../.."

CPU_TAG=${CPU_TAG:-softmoe-serve:0.1.0-cpu}
GPU_TAG=${GPU_TAG:-softmoe-serve:0.1.0-gpu}
BASE_IMAGE=${BASE_IMAGE:-softmoe-base/debian:bookworm}
export BASE_IMAGE
failures=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

docker info >/dev/null 2>&1 || {
    echo "no Docker engine: start one (Debian: apt-get install docker.io; dockerd &)" >&2
    exit 1
}
declare -A build_seconds=()
if [[ -z "${NO_BUILD:-}" ]]; then
    if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && [[ $BASE_IMAGE == softmoe-base/* ]]; then
        start=$(date +%s)
        deploy/images/make-base.sh
        echo "INFO base image $BASE_IMAGE made in $(( $(date +%s) - start )) s"
    fi
    for target in cpu gpu; do
        start=$(date +%s)
        tag_var=${target^^}_TAG
        TAG=${!tag_var} deploy/images/build.sh "$target" --progress plain >"/tmp/softmoe-build-$target.log" 2>&1 \
            || { tail -n 40 "/tmp/softmoe-build-$target.log"; fail "build $target (log /tmp/softmoe-build-$target.log)"; exit 1; }
        build_seconds[$target]=$(( $(date +%s) - start ))
        pass "build $target in ${build_seconds[$target]} s (log /tmp/softmoe-build-$target.log)"
    done
fi

volume=softmoe-check-cache-$$
containers=()
cleanup() {
    for c in "${containers[@]}"; do docker rm -f "$c" >/dev/null 2>&1 || true; done
    docker volume rm -f "$volume" >/dev/null 2>&1 || true
}
trap cleanup EXIT
docker volume create "$volume" >/dev/null
# The Pod's securityContext: read-only root, no capabilities, no privilege escalation.
hardened=(--read-only --tmpfs /tmp:rw,nosuid,nodev --cap-drop ALL --security-opt no-new-privileges
          -v "$volume:/cache")

check_common() {  # image
    local image=$1 user history env
    user=$(docker image inspect --format '{{.Config.User}}' "$image")
    [[ $user == 10001:10001 ]] && pass "$image: USER $user" || fail "$image: USER '$user' (want 10001:10001)"
    history=$(docker history --no-trunc --format '{{.CreatedBy}}' "$image")
    env=$(docker image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$image")
    leaks='127\.0\.0\.1:[0-9]+|find-links|pip\.conf|pipconf|pipca|PIP_(CERT|INDEX|CONFIG|FIND|TRUSTED)[A-Z_]*|[a-z_]*proxy=[^ ]*'
    if grep -q -i -E "$leaks" <<<"$history$env"; then
        fail "$image: build settings in history or env: $(grep -i -o -E "$leaks" <<<"$history$env" | sort -u | tr '\n' ' ')"
    else
        pass "$image: no build settings (pip config, wheel server, proxy) in history or env"
    fi
}

serve_ready() {  # image label [docker run options...]: start, wait for /v2/health/ready, stop
    local image=$1 label=$2 port name url deadline code=000
    shift 2
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    name=softmoe-check-$$-$RANDOM
    containers+=("$name")
    docker run -d --name "$name" "${hardened[@]}" -p "127.0.0.1:$port:8000" "$@" "$image" >/dev/null
    url=http://127.0.0.1:$port
    deadline=$(( $(date +%s) + ${READY_TIMEOUT:-300} ))
    while (( $(date +%s) < deadline )); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "$url/v2/health/ready" || true)
        [[ $code == 200 ]] && break
        [[ $(docker inspect --format '{{.State.Running}}' "$name") == true ]] || break
        sleep 2
    done
    if [[ $code == 200 ]]; then
        pass "$image: $label: /v2/health/ready 200 with --read-only"
        if served=$(python3 - "$url" <<'PY'
import base64, json, struct, sys, urllib.request, zlib

url = sys.argv[1]
models = json.load(urllib.request.urlopen(url + "/v1/models", timeout=10))["data"]
# An 8x8 grayscale PNG of a ring (a "0"), made here: the digits model's input size.
rows = [[255 if 1 <= x <= 6 and 1 <= y <= 6 and not (2 < x < 5 and 2 < y < 5) else 0 for x in range(8)]
        for y in range(8)]
raw = b"".join(b"\0" + bytes(r) for r in rows)
chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0))
       + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
body = json.dumps({"images": [base64.b64encode(png).decode()]}).encode()
req = urllib.request.Request(url + "/v1/classify", body, {"Content-Type": "application/json"})
top = json.load(urllib.request.urlopen(req, timeout=60))["results"][0]["predictions"][0]
names = ", ".join(f"{m['id']} ({m['backend']['backend']})" for m in models)
print(f"models {names}; POST /v1/classify -> label {top['label']}")
PY
        ); then
            pass "$image: $label: $served"
        else
            fail "$image: $label: /v1/models or /v1/classify failed"
        fi
    else
        docker logs --tail 30 "$name" 2>&1 | sed 's/^/    /'
        fail "$image: $label: /v2/health/ready $code"
    fi
    docker stop -t 30 "$name" >/dev/null || true
}

cuda_refused() {  # image label [serve args...]: no GPU on this host, so the server must refuse to start
    local image=$1 label=$2 err rc=0 lines
    shift 2
    err=$(docker run --rm "${hardened[@]}" --network none "$image" serve --port 0 "$@" 2>&1 >/dev/null) || rc=$?
    lines=$(printf '%s\n' "$err" | grep -c . || true)
    if (( rc == 2 && lines == 1 )); then
        pass "$image: $label: exit 2, one line on stderr: $err"
    else
        printf '%s\n' "$err" | tail -n 20 | sed 's/^/    /'
        fail "$image: $label: exit $rc with $lines line(s) on stderr; want exit 2 and one line (no silent CPU)"
    fi
}

inspect_image() {  # image [--gpu] [--lock=/locks/NAME.lock...]; requirements/ is mounted at /locks
    local image=$1
    shift
    docker run --rm -i "${hardened[@]}" --network none -v "$PWD/requirements:/locks:ro" \
        --entrypoint python "$image" - "$@" \
        < deploy/images/inspect_image.py | sed "s|^|    |"
    return "${PIPESTATUS[0]}"
}

echo "== $CPU_TAG"
check_common "$CPU_TAG"
inspect_image "$CPU_TAG" --lock=/locks/cpu.lock && pass "$CPU_TAG: in-image checks" || fail "$CPU_TAG: in-image checks"
serve_ready "$CPU_TAG" "torch backend (default models)"
serve_ready "$CPU_TAG" "onnxruntime backend, ONNX export into /cache" -e SOFTMOE_BACKEND=onnxruntime
if docker run --rm -v "$volume:/cache" --entrypoint sh "$CPU_TAG" -c 'find /cache -name "*.onnx" | grep -q .'; then
    pass "$CPU_TAG: ONNX exports written to the /cache volume"
else
    fail "$CPU_TAG: nothing exported into /cache"
fi

echo "== $GPU_TAG"
check_common "$GPU_TAG"
gpu_locks=(--lock=/locks/gpu.lock)
if docker run --rm --entrypoint sh "$GPU_TAG" -c 'test -d /opt/venv/lib/python3.11/site-packages/tensorrt_libs'; then
    gpu_locks+=(--lock=/locks/tensorrt.lock)
fi
inspect_image "$GPU_TAG" --gpu "${gpu_locks[@]}" && pass "$GPU_TAG: in-image checks" || fail "$GPU_TAG: in-image checks"
if docker run --rm "${hardened[@]}" --network none "$GPU_TAG" --help >/dev/null; then
    pass "$GPU_TAG: softmoe --help with --read-only"
else
    fail "$GPU_TAG: softmoe --help with --read-only"
fi
# No GPU here, onnxruntime-gpu and CUDA torch installed: asked for cuda, each backend refuses to start.
cuda_refused "$GPU_TAG" "--backend onnxruntime --device cuda (onnxruntime-gpu installed)" --backend onnxruntime --device cuda
cuda_refused "$GPU_TAG" "--backend onnxruntime --device cuda --precision fp32" --backend onnxruntime --device cuda --precision fp32
cuda_refused "$GPU_TAG" "--backend torch --device cuda (CUDA torch installed)" --backend torch --device cuda
cuda_refused "$GPU_TAG" "--backend tensorrt (built without TensorRT, or no GPU)" --backend tensorrt
# No GPU here: the image's own Python stack serving on the CPU (ONNX Runtime's CPU provider).
serve_ready "$GPU_TAG" "onnxruntime backend on the CPU (no GPU on this host)" \
    -e SOFTMOE_BACKEND=onnxruntime -e SOFTMOE_DEVICE=cpu -e SOFTMOE_PRECISION=fp32

echo "== sizes"
for image in "$CPU_TAG" "$GPU_TAG"; do
    bytes=$(docker image inspect --format '{{.Size}}' "$image")
    echo "SIZE $image $(numfmt --to=si --suffix=B "$bytes") = $(numfmt --to=iec-i --suffix=B "$bytes") ($bytes bytes)${build_seconds[${image##*-}]:+, built in ${build_seconds[${image##*-}]} s}"
done
if (( failures )); then
    echo "image-check: $failures check(s) failed"
    exit 1
fi
echo "image-check: all checks passed"
