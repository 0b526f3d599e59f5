#!/usr/bin/env bash
# Starts a Docker engine when none answers, as root on a machine without one running:
# no changes to the host firewall (--iptables=false) and no default bridge; compose's
# own networks still work. Layers live under DOCKER_DATA_ROOT and are reused next time.
# Prints the pid of the dockerd it started (nothing if one was running already); exits non-zero,
# saying why on stderr, when the engine cannot start (e.g. no privileges).
set -euo pipefail
docker info >/dev/null 2>&1 && exit 0
root=${DOCKER_DATA_ROOT:-/var/lib/llmserve-docker}
command -v dockerd >/dev/null || { echo "no dockerd (apt-get install docker.io)" >&2; exit 1; }
mkdir -p "$root"
nohup dockerd --storage-driver=overlay2 --iptables=false --bridge=none --data-root="$root" \
  >"$root.log" 2>&1 </dev/null &
pid=$!
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && { echo "$pid"; exit 0; }
  kill -0 "$pid" 2>/dev/null || break
  sleep 1
done
kill "$pid" 2>/dev/null || true
echo "dockerd did not start; the last lines of $root.log:" >&2
tail -n 5 "$root.log" >&2
exit 1
