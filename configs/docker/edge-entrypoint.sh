#!/bin/sh
# Entrypoint of the compose swarm's edge peers: shape this container's uplink to EDGE_MBIT Mbit/s (default 20),
# then run `hetnode` with the container's command as its arguments. Needs cap_add: [NET_ADMIN].
# Only egress is shaped (tc on eth0): the peer measures a slow upload, which is what makes it a stage.
set -eu
tc qdisc replace dev eth0 root tbf rate "${EDGE_MBIT:-20}mbit" burst 32kbit latency 400ms
echo "edge-entrypoint: eth0 egress shaped to ${EDGE_MBIT:-20} Mbit/s" >&2
exec hetnode "$@"
