#!/usr/bin/env bash
# Builds local stand-ins for the two base images the Dockerfiles and compose use,
# python:3.11-slim and redis:7-alpine, for machines that cannot reach Docker Hub.
# Each is a Debian bookworm rootfs from debootstrap, imported with `docker import`.
# An image already there, or that `docker pull` fetches, is left alone; FORCE=1 rebuilds both.
set -euo pipefail

mirror=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
         | grep -v security | head -n1 | awk '{print $2}' || true)
mirror=${DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
work=$(mktemp -d /var/tmp/stand-in.XXXXXX)
trap 'rm -rf "$work"' EXIT

# rootfs TAG PACKAGES: a minbase bookworm with PACKAGES and the host's own CA certificates
# (HTTPS from a build may go through an intercepting proxy that only those make trusted).
rootfs() {
  local root=$work/$1
  debootstrap --variant=minbase --include="$2" bookworm "$root" "$mirror" >"$work/$1.log" \
    || { tail -n 20 "$work/$1.log"; return 1; }
  if [ -d "$root/usr/local/share/ca-certificates" ]; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
    chroot "$root" update-ca-certificates >/dev/null 2>&1
  fi
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
}

has() {
  [ "${FORCE:-0}" != 1 ] && { docker image inspect "$1" >/dev/null 2>&1 || timeout 60 docker pull -q "$1" >/dev/null 2>&1; }
}

if ! has python:3.11-slim; then
  rootfs python python3,python3-venv,python3-pip,ca-certificates,passwd
  root=$work/python
  ln -sf python3 "$root/usr/bin/python"
  ln -sf pip3 "$root/usr/bin/pip"
  rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED  # the official image lets pip install system-wide
  tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - python:3.11-slim >/dev/null
  echo "python:3.11-slim: stand-in built from Debian bookworm"
fi

if ! has redis:7-alpine; then
  rootfs redis redis-server,redis-tools
  root=$work/redis
  # Debian's redis-server refuses clients from other hosts (protected mode); the official image does not.
  mv "$root/usr/bin/redis-server" "$root/usr/bin/redis-server.debian"
  printf '#!/bin/sh\nexec /usr/bin/redis-server.debian "$@" --protected-mode no\n' >"$root/usr/bin/redis-server"
  chmod 755 "$root/usr/bin/redis-server"
  tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'EXPOSE 6379' -c 'CMD ["redis-server"]' - redis:7-alpine >/dev/null
  echo "redis:7-alpine: stand-in built from Debian bookworm"
fi
