#!/usr/bin/env bash
# A two-node Ray cluster on one machine: the head node offers a `draft` resource, the
# worker node a `target` resource, so configs can pin each worker to "its" node exactly
# as on a real cluster (see ray-cluster.yaml and kuberay-rayservice.yaml).
#
#   cluster/local_cluster.sh start    # prints the address to use
#   cluster/local_cluster.sh status
#   cluster/local_cluster.sh stop
set -euo pipefail

RAY=${RAY:-$(dirname "$0")/../.venv/bin/ray}
PORT=${SPECSERVE_RAY_PORT:-6390}
HEAD_CPUS=${SPECSERVE_HEAD_CPUS:-2}
WORKER_CPUS=${SPECSERVE_WORKER_CPUS:-2}
DASHBOARD_PORT=${SPECSERVE_DASHBOARD_PORT:-8265}  # `serve deploy -a http://127.0.0.1:PORT`
TEMP_DIR=${SPECSERVE_RAY_TEMP_DIR:-/tmp/specserve-cluster}
# Ray 2.60 enables token auth on `ray start`; clients (ray.init, `serve deploy`,
# `serve status`) must run with RAY_AUTH_MODE=token too.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
# Serve's Python proxy here by default. RAY_SERVE_ENABLE_HA_PROXY=1 starts Serve's HAProxy
# ingress instead (what `make serve` uses: faster first tokens, bench/ttft.py), but in Ray
# 2.60 an app deployed after `serve shutdown` on the same cluster never comes up with it,
# and this cluster is for deploying config after config.
export RAY_SERVE_ENABLE_HA_PROXY=${RAY_SERVE_ENABLE_HA_PROXY:-0}

case "${1:-}" in
  start)
    # `ray start` with token auth needs a token it will not create: make one the first
    # time (~/.ray/auth_token; RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, when set, win).
    if [ "$RAY_AUTH_MODE" = token ]; then "$RAY" get-auth-token --generate >/dev/null; fi
    "$RAY" start --head --port="$PORT" --num-cpus="$HEAD_CPUS" \
      --resources='{"draft": 4}' --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
      --disable-usage-stats \
      --temp-dir="$TEMP_DIR" >/dev/null
    # A second raylet on the same host is a second Ray node with its own node id.
    "$RAY" start --address="127.0.0.1:$PORT" --num-cpus="$WORKER_CPUS" \
      --resources='{"target": 4}' --disable-usage-stats >/dev/null
    echo "127.0.0.1:$PORT"
    ;;
  status)
    "$RAY" status --address="127.0.0.1:$PORT"
    ;;
  stop)
    # Only this cluster's processes: `ray stop` would also end any other Ray on the host.
    pattern="$TEMP_DIR|:$PORT( |$)"
    pkill -TERM -f -- "$pattern" || true
    for _ in $(seq 25); do pgrep -f -- "$pattern" >/dev/null || exit 0; sleep 0.2; done
    pkill -KILL -f -- "$pattern" || true
    ;;
  *)
    echo "usage: $0 start|status|stop" >&2
    exit 2
    ;;
esac
