#!/usr/bin/env bash
# A base image for docker/Dockerfile made from Debian's packages, for hosts that reach no image registry:
# a minimal Debian (python3 and its venv module, CA certificates, a C compiler for the CPU executor's
# kernels) by debootstrap, imported as one layer.
#   docker/base_image.sh [TAG]     default tag deltaserve-base:bookworm; needs root, debootstrap and docker
# Then: docker build -f docker/Dockerfile --build-arg BASE_IMAGE=deltaserve-base:bookworm ...
set -euo pipefail

tag="${1:-deltaserve-base:bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"  # bookworm's python3 is 3.11, the version the project pins its wheels for
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

rootfs="$(mktemp -d /tmp/deltaserve-rootfs.XXXXXX)"
chmod 755 "$rootfs"  # it becomes the image's /: mktemp's 0700 would shut the non-root user out of everything
trap 'umount -l "$rootfs/proc" "$rootfs/sys" 2>/dev/null || true; rm -rf "$rootfs"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,gcc,libc6-dev "$suite" "$rootfs" "$mirror"
# The host's CA bundle, so that pip in a build trusts what the host's pip trusts (a TLS-inspecting proxy's
# CA among them); HOST_CA_BUNDLE= keeps Debian's own.
ca_bundle="${HOST_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}"
if [[ -n "$ca_bundle" ]]; then
  cp "$ca_bundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
# What an image never reads: apt's lists and caches, documentation, manuals, translations.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/log/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
tar -C "$rootfs" --numeric-owner --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' -c . |
  docker import --change 'CMD ["python3"]' - "$tag"
echo "$tag"
