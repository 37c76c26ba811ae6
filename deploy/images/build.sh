#!/usr/bin/env bash
# Build one target of the Dockerfile with BuildKit, handing this host's pip settings to that
# build alone (BuildKit secrets, never a layer):
#
#   deploy/images/build.sh cpu|gpu [docker build options...]
#
# Environment:
#   TAG            image tag (default softmoe-serve:0.1.0-<target>)
#   BASE_IMAGE     default softmoe-base/debian:bookworm (deploy/images/make-base.sh makes it
#                  from Debian packages); debian:bookworm-slim where a registry is reachable
#   WITH_TENSORRT  gpu: 1 installs requirements/tensorrt.lock (needs pypi.nvidia.com); default 1
#                  when that lock exists, else 0 (the image then defaults to ONNX Runtime)
#   LOCAL_WHEELS   a folder of wheels to offer pip (default /opt/wheels where it exists: this
#                  machine's copy of torch 2.13.0+cpu), served on 127.0.0.1 for the build only
#   DOCKER         the docker client (default: `docker buildx build --load` where buildx exists,
#                  else a client with BuildKit built in, e.g. Debian's docker.io 20.10)
#
# The pip configuration passed in: index-url, extra-index-url (http/https only), proxy and
# trusted-host from `pip config list` and PIP_* variables, the CA bundle (pip's `cert`) as the
# secret `pipca`, and LOCAL_WHEELS as a find-links URL. With none of these the build uses PyPI
# and download.pytorch.org (TORCH_CPU_FIND_LINKS in the Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/../.."

target=${1:?usage: deploy/images/build.sh cpu|gpu [docker build options]}
shift
[[ $target == cpu || $target == gpu ]] || { echo "target must be cpu or gpu" >&2; exit 2; }
TAG=${TAG:-softmoe-serve:0.1.0-$target}
BASE_IMAGE=${BASE_IMAGE:-softmoe-base/debian:bookworm}
if [[ -z "${WITH_TENSORRT:-}" ]]; then
    if [[ -f requirements/tensorrt.lock ]]; then WITH_TENSORRT=1; else WITH_TENSORRT=0; fi
fi
if [[ -z "${LOCAL_WHEELS+x}" && -d /opt/wheels ]]; then LOCAL_WHEELS=/opt/wheels; fi

if [[ -n "${DOCKER:-}" ]]; then
    read -r -a docker_build <<<"$DOCKER"
elif docker buildx version >/dev/null 2>&1; then
    docker_build=(docker buildx build --load)
else
    # A client whose own `docker build` speaks BuildKit (before 23.0 it did without buildx).
    client=docker
    if ! docker version --format '{{.Client.Version}}' 2>/dev/null | grep -q '^20\.'; then
        client=/usr/bin/docker
    fi
    "$client" version --format '{{.Client.Version}}' 2>/dev/null | grep -q '^20\.' \
        || { echo "no BuildKit client: install docker-buildx, or Debian's docker.io" >&2; exit 1; }
    export DOCKER_BUILDKIT=1
    docker_build=("$client" build)
fi
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && [[ $BASE_IMAGE == softmoe-base/* ]]; then
    echo "$BASE_IMAGE missing: make base-image (deploy/images/make-base.sh)" >&2
    exit 1
fi

tmp=$(mktemp -d)
server_pid=
cleanup() {
    [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null
    rm -rf "$tmp"
}
trap cleanup EXIT

# pip's settings on this host, for the build alone.
pipget() {  # the first value of a pip setting: PIP_<NAME> or `pip config` (any scope)
    local env="PIP_$(tr 'a-z-' 'A-Z_' <<<"$1")"
    if [[ -n "${!env:-}" ]]; then echo "${!env}"; return; fi
    python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:]*\.$1='\(.*\)'$/\1/p" | head -n1
}
conf=$tmp/pip.conf
echo "[global]" > "$conf"
index=$(pipget index-url)
[[ $index == http* ]] && echo "index-url = $index" >> "$conf"
extra=$(pipget extra-index-url | tr ' ' '\n' | grep '^http' | tr '\n' ' ' || true)
[[ -n "$extra" ]] && echo "extra-index-url = $extra" >> "$conf"
for key in proxy trusted-host timeout default-timeout retries; do
    value=$(pipget "$key")
    [[ -n "$value" ]] && echo "$key = $value" >> "$conf"
done
proxy=${https_proxy:-${HTTPS_PROXY:-}}
[[ -n "$proxy" ]] && ! grep -q '^proxy' "$conf" && echo "proxy = $proxy" >> "$conf"
secrets=(--secret "id=pipconf,src=$conf")
cert=$(pipget cert)
[[ -n "$cert" && -f "$cert" ]] && secrets+=(--secret "id=pipca,src=$cert")

network=()
build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
if [[ -n "${LOCAL_WHEELS:-}" ]]; then
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m http.server --bind 127.0.0.1 --directory "$LOCAL_WHEELS" "$port" >"$tmp/http.log" 2>&1 &
    server_pid=$!
    echo "find-links = http://127.0.0.1:$port/" >> "$conf"
    # The loopback server is reachable from the build's RUN steps on the host network only.
    network=(--network host)
    build_args+=(--build-arg "TORCH_CPU_FIND_LINKS=")
    for _ in $(seq 50); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" \
            2>/dev/null && break
        sleep 0.1
    done
fi
if [[ $target == gpu ]]; then
    build_args+=(--build-arg "WITH_TENSORRT=$WITH_TENSORRT")
    [[ $WITH_TENSORRT == 1 ]] || build_args+=(--build-arg "GPU_BACKEND=onnxruntime")
fi

echo "building $TAG (target $target, base $BASE_IMAGE${WITH_TENSORRT:+, WITH_TENSORRT=$WITH_TENSORRT})" >&2
start=$(date +%s)
"${docker_build[@]}" --target "$target" -t "$TAG" "${network[@]}" "${secrets[@]}" "${build_args[@]}" "$@" .
echo "built $TAG in $(( $(date +%s) - start )) s" >&2
