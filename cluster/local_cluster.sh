#!/usr/bin/env bash
# A Ray cluster of several nodes on one machine: a head node without custom resources and
# worker nodes that offer the resources configs pin workers with (`draft`, `target`), so
# that a worker can be placed on "its" node exactly as on a real cluster (ray-cluster.yaml,
# kuberay-rayservice.yaml), and one node can be lost and brought back without the rest.
#
#   cluster/local_cluster.sh start                # head + the nodes of SPECSERVE_NODES
#   cluster/local_cluster.sh add-node NAME CPUS [RES=N,...]   # one more worker node
#   cluster/local_cluster.sh stop-node NAME       # lose it: SIGKILL of all its processes
#   cluster/local_cluster.sh start-node NAME      # it returns, with the resources it had
#   cluster/local_cluster.sh nodes                # NAME CPUS RESOURCES up|down
#   cluster/local_cluster.sh status | stop
#
# SPECSERVE_NODES lists the worker nodes `start` adds, as NAME:CPUS[:RES=N,...] separated
# by spaces; by default a `target` node (2 CPUs, target=4) and a `draft` node (1 CPU,
# draft=4). Each worker node runs in a process group of its own (`ray start --block` under
# setsid), so stopping it kills its raylet, its agents and its workers at once, as when a
# machine goes away, and leaves the other nodes running.
set -euo pipefail

RAY=${RAY:-$(dirname "$0")/../.venv/bin/ray}
PORT=${SPECSERVE_RAY_PORT:-6390}
HEAD_CPUS=${SPECSERVE_HEAD_CPUS:-2}
NODES=${SPECSERVE_NODES:-"target:2:target=4 draft:1:draft=4"}
DASHBOARD_PORT=${SPECSERVE_DASHBOARD_PORT:-8265}  # `serve deploy -a http://127.0.0.1:PORT`
TEMP_DIR=${SPECSERVE_RAY_TEMP_DIR:-/tmp/specserve-cluster}
STATE="$TEMP_DIR-nodes"  # NAME.spec (cpus, resources), NAME.pid (process group), NAME.log
# Ray 2.60 enables token auth on `ray start`; clients (ray.init, `serve deploy`,
# `serve status`) must run with RAY_AUTH_MODE=token too.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
# Serve's Python proxy here by default. RAY_SERVE_ENABLE_HA_PROXY=1 starts Serve's HAProxy
# ingress instead (what `make serve` uses: faster first tokens, bench/ttft.py), but in Ray
# 2.60 an app deployed after `serve shutdown` on the same cluster never comes up with it,
# and this cluster is for deploying config after config.
export RAY_SERVE_ENABLE_HA_PROXY=${RAY_SERVE_ENABLE_HA_PROXY:-0}

die() {
  echo "local_cluster.sh: $*" >&2
  exit 2
}

# "draft=4,x=1" -> {"draft": 4, "x": 1}
resources_json() {
  local out="" pair
  local IFS=,
  for pair in $1; do
    [[ $pair =~ ^[A-Za-z_][A-Za-z0-9_-]*=[0-9]+(\.[0-9]+)?$ ]] || die "bad resource '$pair' (want NAME=COUNT)"
    out+="${out:+, }\"${pair%%=*}\": ${pair#*=}"
  done
  echo "{$out}"
}

node_up() {
  local pid
  [ -f "$STATE/$1.pid" ] || return 1
  pid=$(cat "$STATE/$1.pid")
  pgrep -r R,S,D,T,I -s "$pid" >/dev/null  # (a zombie is not up)
}

start_node() {
  local name=$1 cpus resources
  [ -f "$STATE/$name.spec" ] || die "no node '$name' (add-node first)"
  read -r cpus resources <"$STATE/$name.spec"
  node_up "$name" && die "node '$name' is already up"
  # `ray start` gives up when its raylet has not registered within 30 s (a constant in
  # Ray 2.60), which a loaded 2-core host can exceed: try again, up to three times.
  for attempt in 1 2 3; do
    launch_node "$name" "$cpus" "$resources" && return 0
    echo "local_cluster.sh: node '$name' did not start (attempt $attempt)" >&2
  done
  cat "$STATE/$name.log" >&2
  die "node '$name' did not start (log: $STATE/$name.log)"
}

# One try: `ray start --block` in a session of its own (stop-node kills exactly this node);
# true once it says the node runs, false (its processes killed) when it gave up. No log
# monitor: the nodes of one machine share the head's session directory, which the head's
# log monitor already tails (one per node would publish each line once per node, and each
# scans every worker's log file ten times a second).
launch_node() {
  local name=$1 cpus=$2 resources=$3 log="$STATE/$1.log" pid
  : >"$log"
  setsid "$RAY" start --address="127.0.0.1:$PORT" --num-cpus="$cpus" \
    --resources="$(resources_json "$resources")" --disable-usage-stats --block \
    --include-log-monitor=False \
    >"$log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$STATE/$name.pid"
  for _ in $(seq 600); do
    grep -q "Ray runtime started" "$log" && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  pkill -KILL -s "$pid" || true
  return 1
}

add_node() {
  local name=$1 cpus=$2 resources=${3:-}
  [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || die "bad node name '$name'"
  [[ $cpus =~ ^[0-9]+$ ]] || die "bad CPU count '$cpus'"
  [ -n "$resources" ] && resources_json "$resources" >/dev/null
  mkdir -p "$STATE"
  echo "$cpus ${resources:-}" >"$STATE/$name.spec"
  start_node "$name"
}

stop_node() {
  local name=$1 pid
  [ -f "$STATE/$name.spec" ] || die "no node '$name'"
  node_up "$name" || return 0
  pid=$(cat "$STATE/$name.pid")
  # The session, not the process group: Ray's workers have groups of their own.
  pkill -KILL -s "$pid" || true
  for _ in $(seq 50); do
    node_up "$name" || return 0
    sleep 0.1
  done
  die "node '$name' is still running"
}

case "${1:-}" in
  start)
    # `ray start` with token auth needs a token it will not create: make one the first
    # time (~/.ray/auth_token; RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, when set, win).
    if [ "$RAY_AUTH_MODE" = token ]; then "$RAY" get-auth-token --generate >/dev/null; fi
    for spec in "$STATE"/*.spec; do
      [ -f "$spec" ] || continue
      node_up "$(basename "$spec" .spec)" && die "a cluster is up ($STATE): stop it first"
    done
    rm -rf "$STATE"
    mkdir -p "$STATE"
    "$RAY" start --head --port="$PORT" --num-cpus="$HEAD_CPUS" \
      --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
      --disable-usage-stats \
      --temp-dir="$TEMP_DIR" >/dev/null
    for node in $NODES; do
      IFS=: read -r name cpus resources <<<"$node"
      add_node "$name" "$cpus" "${resources:-}"
    done
    echo "127.0.0.1:$PORT"
    ;;
  add-node)
    [ $# -ge 3 ] || die "usage: $0 add-node NAME CPUS [RES=N,...]"
    add_node "$2" "$3" "${4:-}"
    ;;
  stop-node)
    [ $# -eq 2 ] || die "usage: $0 stop-node NAME"
    stop_node "$2"
    ;;
  start-node)
    [ $# -eq 2 ] || die "usage: $0 start-node NAME"
    start_node "$2"
    ;;
  nodes)
    for spec in "$STATE"/*.spec; do
      [ -f "$spec" ] || continue
      name=$(basename "$spec" .spec)
      read -r cpus resources <"$spec"
      if node_up "$name"; then state=up; else state=down; fi
      echo "$name $cpus ${resources:--} $state"
    done
    ;;
  status)
    "$RAY" status --address="127.0.0.1:$PORT"
    ;;
  stop)
    for spec in "$STATE"/*.spec; do
      [ -f "$spec" ] || continue
      (stop_node "$(basename "$spec" .spec)") || true  # (the head goes below whatever)
    done
    # Only this cluster's processes: `ray stop` would also end any other Ray on the host.
    pattern="$TEMP_DIR|:$PORT( |$)"
    pkill -TERM -f -- "$pattern" || true
    for _ in $(seq 25); do pgrep -f -- "$pattern" >/dev/null || exit 0; sleep 0.2; done
    pkill -KILL -f -- "$pattern" || true
    ;;
  *)
    echo "usage: $0 start|add-node|stop-node|start-node|nodes|status|stop" >&2
    exit 2
    ;;
esac
