#!/bin/sh
# Roles for deploy/compose.yaml: one relay, the node that creates the mesh, and
# members that join with an invite. They coordinate through the shared
# /bootstrap volume: the relay publishes its id, the first node publishes the
# mesh id and one invite per member. Invites are secrets: the volume is only
# mounted into these containers.
#
# Every role ends in `exec meshnode ...`: the node replaces this shell, so the
# SIGTERM of `docker stop` reaches it and it drains (a shell as PID 1 would
# swallow the signal). MESHNODE_BOOTSTRAP_DIR moves the shared directory (tests).
set -eu
shared=${MESHNODE_BOOTSTRAP_DIR:-/bootstrap}
role=$1
shift

wait_for() {
  while [ ! -s "$1" ]; do sleep 1; done
}

case "$role" in
  relay)
    meshnode relay --show-id > "$shared/relay_id.tmp"
    mv "$shared/relay_id.tmp" "$shared/relay_id"
    wait_for "$shared/mesh_id"
    exec meshnode relay --listen 0.0.0.0:7448 --mesh "$(cat "$shared/mesh_id")" "$@"
    ;;
  first)
    wait_for "$shared/relay_id"
    relay="$(cat "$shared/relay_id")@relay:7448"
    # Once the node answers, publish its mesh id and an invite per member (from a
    # helper in the background, since the node itself takes over this process).
    (
      until meshnode status --json > "$shared/status.json" 2>/dev/null; do sleep 1; done
      python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["node"]["mesh_id"])' \
        "$shared/status.json" > "$shared/mesh_id"
      for member in ${MESHNODE_MEMBERS:-}; do
        [ -s "$shared/invite-$member" ] || meshnode invite --ttl 1h > "$shared/invite-$member"
      done
    ) &
    # `up` creates the mesh on the first run and starts the member on every later one.
    exec meshnode up --relay "$relay" "$@"
    ;;
  member)
    if [ -s "$MESHNODE_DATA_DIR/membership.json" ]; then
      exec meshnode start "$@"
    fi
    wait_for "$shared/invite-$(hostname)"
    exec meshnode join --invite - "$@" < "$shared/invite-$(hostname)"
    ;;
  *)
    echo "usage: bootstrap.sh relay|first|member [meshnode options]" >&2
    exit 2
    ;;
esac
