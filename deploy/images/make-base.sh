#!/usr/bin/env bash
# Build the images' base, softmoe-base/debian:<release>, from Debian packages alone: the
# air-gapped path for hosts that reach a Debian mirror but no image registry.
#
#   deploy/images/make-base.sh                 # bookworm from this host's apt mirror
#   RELEASE=bookworm MIRROR=http://deb.debian.org/debian deploy/images/make-base.sh
#
# debootstrap --variant=minbase installs the Essential and Priority: required packages (what the
# official debian:<release>-slim image starts from), then the apt sources get <release>,
# <release>-updates and <release>-security like the official image, and the tree is imported as
# a one-layer image. Needs root, debootstrap and a running Docker engine. The Dockerfile takes
# the result as its default BASE_IMAGE; `--build-arg BASE_IMAGE=debian:<release>-slim` uses the
# registry's image instead (same release, same packages).
set -euo pipefail

RELEASE=${RELEASE:-bookworm}
if [[ -z "${MIRROR:-}" ]]; then
    # The first Debian mirror this host's apt uses (deb822 or one-line sources), else the CDN.
    MIRROR=$(grep -h -E '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
             | grep -o -E 'https?://[^ ]+/debian/?$|https?://[^ ]+/debian/? ' | tr -d ' ' | head -n1 || true)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
SECURITY_MIRROR=${SECURITY_MIRROR:-${MIRROR%/debian*}/debian-security}
TAG=${TAG:-softmoe-base/debian:$RELEASE}

command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install debootstrap" >&2; exit 1; }
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT

echo "debootstrap --variant=minbase $RELEASE from $MIRROR" >&2
debootstrap --variant=minbase "$RELEASE" "$rootfs" "$MIRROR" >&2

rm -f "$rootfs/etc/apt/sources.list"
cat > "$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $MIRROR
Suites: $RELEASE $RELEASE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: $RELEASE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
# What the official image does: no recommends, no apt caches, no docs nor man pages.
cat > "$rootfs/etc/apt/apt.conf.d/docker-clean" <<'APT'
APT::Install-Recommends "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
APT
cat > "$rootfs/etc/dpkg/dpkg.cfg.d/docker-slim" <<'DPKG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
DPKG
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
       "$rootfs"/usr/share/doc/*/changelog* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
       "$rootfs"/var/log/* "$rootfs"/tmp/*
# A fresh machine-id per container, not one baked in here.
: > "$rootfs/etc/machine-id"

tar --numeric-owner -C "$rootfs" -c . \
    | docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' \
        --message "debootstrap --variant=minbase $RELEASE $MIRROR" - "$TAG" >/dev/null
echo "$TAG ($(docker image inspect --format '{{.Size}}' "$TAG" | numfmt --to=iec) from $RELEASE at $MIRROR)"
