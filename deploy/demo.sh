#!/usr/bin/env bash
# The main job: builds the workspace, starts the decider, the executor and the
# driver as three separate processes on loopback (ports chosen by the OS and
# read from ready files), applies deploy/examples/shape.yaml and follows the run
# until it converges, then deletes it. Exits 0 when it converges, non-zero with
# the reason when it does not within DEMO_TIMEOUT seconds (default 120).
#
# Every node is a real node-agent process (the `process` backend) listening on
# a loopback port and streaming its bootstrap; DEMO_BACKEND=fake uses the
# in-memory provider instead (the shape's `provider: process` names become
# `fake`, the name the executor serves it under).
#
# Everything talks TLS: `provisionctl certs` writes a development CA and a
# certificate per service (and one for provisionctl) into the demo's temporary
# directory; the decider and the executor take calls only from the driver's
# certificate. DEMO_INSECURE=1 runs it all in plaintext (--insecure) instead.
#
# Clients authenticate: the demo makes a write token (`provisionctl token
# new`), gives the driver its hash in a tokens file (--tokens-file) and
# provisionctl the token (PROVISIONCTL_TOKEN_FILE).
#
# With DEMO_TELEMETRY=1 the services serve Prometheus metrics and export
# traces over OTLP/gRPC on the addresses of deploy/telemetry.env, which
# deploy/prometheus.yml and deploy/otel-collector.yaml point at.
#
# Usage: deploy/demo.sh [shape-file]
set -euo pipefail
cd "$(dirname "$0")/.."

shape=${1:-deploy/examples/shape.yaml}
timeout=${DEMO_TIMEOUT:-120}
backend=${DEMO_BACKEND:-process}

decider_telemetry=()
executor_telemetry=()
driver_telemetry=()
if [ "${DEMO_TELEMETRY:-0}" = 1 ]; then
    # shellcheck source=telemetry.env
    . deploy/telemetry.env
    export OTEL_EXPORTER_OTLP_ENDPOINT="http://$OTLP_GRPC"
    decider_telemetry=(--metrics-listen "$DECIDER_METRICS")
    executor_telemetry=(--metrics-listen "$EXECUTOR_METRICS")
    driver_telemetry=(--metrics-listen "$DRIVER_METRICS")
    echo "demo: metrics at http://$DRIVER_METRICS, http://$DECIDER_METRICS, http://$EXECUTOR_METRICS;" \
        "traces to $OTEL_EXPORTER_OTLP_ENDPOINT"
fi

cargo build --workspace --bins --locked
bin=target/debug

work=$(mktemp -d)
# Each holder's TLS flags, by name (decider-svc, executor-svc, driver-svc,
# provisionctl), into the array named by the first argument.
if [ "${DEMO_INSECURE:-0}" != 1 ]; then
    "$bin/provisionctl" certs --out "$work/certs" --days 1 >/dev/null
fi
tls_for() {
    local -n flags=$1
    if [ "${DEMO_INSECURE:-0}" = 1 ]; then
        flags=(--insecure)
    else
        flags=(--tls-ca "$work/certs/ca.pem" --tls-cert "$work/certs/$2.pem" --tls-key "$work/certs/$2.key")
    fi
}
tls_for decider_tls decider-svc
tls_for executor_tls executor-svc
tls_for driver_tls driver-svc
tls_for ctl_tls provisionctl
pids=()
# Node agents outlive their executor by design, so the demo ends the ones its
# run left (a run that converged was deleted, and left none) by the PID each
# recorded in its agent.json, and only if that PID is still the same process:
# its start time in /proc/PID/stat (field 22) is the one recorded.
end_agents() {
    local rec pid start now
    while IFS= read -r -d '' rec; do
        pid=$(sed -n 's/.*"pid":\([0-9][0-9]*\).*/\1/p' "$rec")
        start=$(sed -n 's/.*"start_time":\([0-9][0-9]*\).*/\1/p' "$rec")
        [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || continue
        now=$(sed 's/^.*) //' "/proc/$pid/stat" | awk '{print $20}')
        if [ "$now" = "$start" ]; then kill "$pid" 2>/dev/null || true; fi
    done < <(find "$work/agents" -name agent.json -print0 2>/dev/null)
}
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    end_agents
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

wait_ready() {
    local file=$1 name=$2 pid=$3
    for _ in $(seq 1 300); do
        if [ -s "$file" ]; then cat "$file"; return 0; fi
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "demo: $name exited before it was ready; its log:" >&2
            cat "$work/$name.log" >&2
            return 1
        fi
        sleep 0.1
    done
    echo "demo: $name did not become ready" >&2
    return 1
}

"$bin/decider-svc" --listen 127.0.0.1:0 --ready-file "$work/decider.ready" "${decider_tls[@]}" \
    "${decider_telemetry[@]}" \
    2>"$work/decider-svc.log" &
pids+=($!)
decider=$(wait_ready "$work/decider.ready" decider-svc $!)

case "$backend" in
    process) backend_args=(--backend process --process-state-dir "$work/agents" --state-dir "$work/executor-state") ;;
    fake) backend_args=(--backend fake --fake-latency-ms 20,200 --fake-stage-interval-ms 150) ;;
    *) echo "demo: DEMO_BACKEND must be process or fake" >&2; exit 2 ;;
esac
"$bin/executor-svc" --listen 127.0.0.1:0 --ready-file "$work/executor.ready" "${executor_tls[@]}" \
    "${backend_args[@]}" "${executor_telemetry[@]}" \
    2>"$work/executor-svc.log" &
pids+=($!)
executor=$(wait_ready "$work/executor.ready" executor-svc $!)

# Client authentication: a write token for the demo. `provisionctl token new`
# prints the token's tokens-file entry (its SHA-256, never the token) and saves
# the token itself, which provisionctl then sends (PROVISIONCTL_TOKEN_FILE).
"$bin/provisionctl" token new demo --access write --save "$work/demo.token" \
    >"$work/tokens.yaml" 2>/dev/null
export PROVISIONCTL_TOKEN_FILE="$work/demo.token"

"$bin/driver-svc" --listen 127.0.0.1:0 --ready-file "$work/driver.ready" "${driver_tls[@]}" \
    --decider "$decider" --executor "$executor" --data-dir "$work/driver-data" \
    --tokens-file "$work/tokens.yaml" \
    "${driver_telemetry[@]}" 2>"$work/driver-svc.log" &
pids+=($!)
driver=$(wait_ready "$work/driver.ready" driver-svc $!)

echo "demo: decider $decider, executor $executor, driver $driver"
ctl() { "$bin/provisionctl" --server "$driver" "${ctl_tls[@]}" "$@"; }
if [ "$backend" = fake ]; then
    sed 's/name: process\b/name: fake/' "$shape" >"$work/shape-fake.yaml"
    shape="$work/shape-fake.yaml"
fi
ctl apply -f "$shape"
run_id=$(sed -n 's/^run_id:[[:space:]]*//p' "$shape" | head -n 1)
if ctl watch "$run_id" --timeout "${timeout}s"; then
    ctl get "$run_id"
    echo "demo: converged; deleting the run"
    ctl delete "$run_id" --wait --timeout 60s
    echo "demo: done"
else
    code=$?
    echo "demo: run $run_id did not converge (exit $code); driver log tail:" >&2
    tail -n 30 "$work/driver-svc.log" >&2
    exit "$code"
fi
