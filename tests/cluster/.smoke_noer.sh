#!/usr/bin/env bash
# Smoke check of the control plane built by build.sh (manual; not run by CI).
#
#   tests/cluster/smoke.sh
#
# Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler on
# 127.0.0.1 (free ports, fresh certs, a temp dir), checks each becomes healthy,
# that controllers and the scheduler act on a Deployment, then stops everything.
# Env: DPSERVE_K8S_BIN (skip build.sh, use this bin dir), KUBECTL (default kubectl),
#      KEEP=1 (keep the temp dir with logs and certs).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BIN="${DPSERVE_K8S_BIN:-$("$HERE/build.sh" | tail -n1)}"
KUBECTL="${KUBECTL:-kubectl}"
for b in etcd kube-apiserver kube-controller-manager kube-scheduler; do
    [[ -x "$BIN/$b" ]] || { echo "smoke: missing $BIN/$b" >&2; exit 1; }
done
for t in openssl curl python3 "$KUBECTL"; do
    command -v "$t" >/dev/null || { echo "smoke: $t not found" >&2; exit 1; }
done

D=$(mktemp -d "${TMPDIR:-/tmp}/dpserve-k8s-smoke.XXXXXX")
PIDS=()
cleanup() {
    local rc=$? i pid
    # Newest first (scheduler, controller-manager, apiserver, etcd), each given up
    # to 10 s to exit on SIGTERM before SIGKILL, so leases are released cleanly.
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        pid=${PIDS[i]}
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if ((rc != 0)); then
        echo "smoke: FAILED (rc=$rc); last log lines:" >&2
        for f in "$D"/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done
    fi
    if [[ "${KEEP:-0}" == 1 ]]; then echo "smoke: kept $D" >&2; else rm -rf "$D"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { echo "smoke: $*" >&2; }

# wait_for SECONDS DESCRIPTION CMD...: poll CMD every 0.5 s.
wait_for() {
    local secs=$1 what=$2 i
    shift 2
    for ((i = 0; i < secs * 2; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    log "timed out after ${secs}s waiting for $what"
    return 1
}

# Free TCP ports on 127.0.0.1 (bound together so they are distinct).
read -r ETCD_PORT PEER_PORT API_PORT KCM_PORT SCHED_PORT < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)

# --- certificates -------------------------------------------------------------
P="$D/pki"
mkdir -p "$P"
ossl() { openssl "$@" 2>>"$D/openssl.log"; }
ossl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout "$P/ca.key" -out "$P/ca.crt" \
    -subj "/CN=dpserve-smoke-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
# sign NAME SUBJECT EXTENSIONS
sign() {
    ossl req -new -newkey rsa:2048 -nodes -keyout "$P/$1.key" -out "$P/$1.csr" -subj "$2"
    printf '%s\n' "$3" >"$P/$1.ext"
    ossl x509 -req -in "$P/$1.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial \
        -days 2 -out "$P/$1.crt" -extfile "$P/$1.ext"
}
sign apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
sign admin "/O=system:masters/CN=kubernetes-admin" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
# Front-proxy (request-header) CA and client, as kubeadm sets up: without it the
# controller-manager and scheduler log errors about a missing requestheader CA.
ossl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout "$P/front-proxy-ca.key" \
    -out "$P/front-proxy-ca.crt" -subj "/CN=dpserve-smoke-front-proxy-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
ossl req -new -newkey rsa:2048 -nodes -keyout "$P/front-proxy-client.key" \
    -out "$P/front-proxy-client.csr" -subj "/CN=front-proxy-client"
printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=clientAuth" >"$P/front-proxy-client.ext"
ossl x509 -req -in "$P/front-proxy-client.csr" -CA "$P/front-proxy-ca.crt" \
    -CAkey "$P/front-proxy-ca.key" -CAcreateserial -days 2 -out "$P/front-proxy-client.crt" \
    -extfile "$P/front-proxy-client.ext"
ossl genrsa -out "$P/sa.key" 2048
ossl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub"

KCFG="$D/admin.kubeconfig"
"$KUBECTL" config --kubeconfig="$KCFG" set-cluster smoke --server="https://127.0.0.1:$API_PORT" \
    --certificate-authority="$P/ca.crt" --embed-certs=true >/dev/null
"$KUBECTL" config --kubeconfig="$KCFG" set-credentials admin \
    --client-certificate="$P/admin.crt" --client-key="$P/admin.key" --embed-certs=true >/dev/null
"$KUBECTL" config --kubeconfig="$KCFG" set-context smoke --cluster=smoke --user=admin >/dev/null
"$KUBECTL" config --kubeconfig="$KCFG" use-context smoke >/dev/null
k() { "$KUBECTL" --kubeconfig="$KCFG" "$@"; }

# --- etcd ---------------------------------------------------------------------
log "etcd on 127.0.0.1:$ETCD_PORT"
"$BIN/etcd" \
    --name=smoke \
    --data-dir="$D/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$PEER_PORT" \
    --initial-advertise-peer-urls="http://127.0.0.1:$PEER_PORT" \
    --initial-cluster="smoke=http://127.0.0.1:$PEER_PORT" \
    --unsafe-no-fsync=true \
    --log-level=warn \
    >"$D/etcd.log" 2>&1 &
PIDS+=($!)
wait_for 30 "etcd /health" curl -fsS "http://127.0.0.1:$ETCD_PORT/health"

# --- kube-apiserver -----------------------------------------------------------
log "kube-apiserver on https://127.0.0.1:$API_PORT"
"$BIN/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 \
    --advertise-address=127.0.0.1 \
    --secure-port="$API_PORT" \
    --cert-dir="$D/apiserver-certs" \
    --tls-cert-file="$P/apiserver.crt" \
    --tls-private-key-file="$P/apiserver.key" \
    --client-ca-file="$P/ca.crt" \
    --authorization-mode=Node,RBAC \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$P/sa.pub" \
    --service-account-signing-key-file="$P/sa.key" \
    --service-cluster-ip-range=10.96.0.0/24 \
    --requestheader-client-ca-file="$P/front-proxy-ca.crt" \
    --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User \
    --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$P/front-proxy-client.crt" \
    --proxy-client-key-file="$P/front-proxy-client.key" \

    --allow-privileged=true \
    >"$D/kube-apiserver.log" 2>&1 &
PIDS+=($!)
wait_for 90 "kube-apiserver /readyz" \
    curl -fsS --cacert "$P/ca.crt" --cert "$P/admin.crt" --key "$P/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz"
log "kubectl get --raw /version:"
k get --raw /version
echo
k get ns

# --- kube-controller-manager and kube-scheduler -------------------------------
log "kube-controller-manager on https://127.0.0.1:$KCM_PORT"
"$BIN/kube-controller-manager" \
    --kubeconfig="$KCFG" \
    --authentication-kubeconfig="$KCFG" \
    --authorization-kubeconfig="$KCFG" \
    --bind-address=127.0.0.1 \
    --secure-port="$KCM_PORT" \
    --leader-elect=true \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$P/sa.key" \
    --root-ca-file="$P/ca.crt" \
    --cluster-signing-cert-file="$P/ca.crt" \
    --cluster-signing-key-file="$P/ca.key" \
    >"$D/kube-controller-manager.log" 2>&1 &
PIDS+=($!)
log "kube-scheduler on https://127.0.0.1:$SCHED_PORT"
"$BIN/kube-scheduler" \
    --kubeconfig="$KCFG" \
    --authentication-kubeconfig="$KCFG" \
    --authorization-kubeconfig="$KCFG" \
    --bind-address=127.0.0.1 \
    --secure-port="$SCHED_PORT" \
    --leader-elect=true \
    >"$D/kube-scheduler.log" 2>&1 &
PIDS+=($!)

wait_for 60 "kube-controller-manager /healthz" curl -fsSk "https://127.0.0.1:$KCM_PORT/healthz"
wait_for 60 "kube-scheduler /healthz" curl -fsSk "https://127.0.0.1:$SCHED_PORT/healthz"
wait_for 60 "leader leases" k -n kube-system get lease kube-controller-manager kube-scheduler
k -n kube-system get lease

# Controllers at work: default service account, and a Deployment -> ReplicaSet -> Pod,
# which the scheduler marks Unschedulable (there are no nodes).
wait_for 60 "default service account" k -n default get serviceaccount default
k create deployment smoke --image=registry.invalid/pause:none --replicas=1 >/dev/null
wait_for 60 "the Deployment's pod" \
    bash -c "'$KUBECTL' --kubeconfig='$KCFG' get pods -l app=smoke -o name | grep -q pod/"
pod_unschedulable() {
    k get pods -l app=smoke \
        -o jsonpath='{.items[0].status.conditions[?(@.type=="PodScheduled")].reason}' |
        grep -q Unschedulable
}
wait_for 60 "scheduler to mark the pod Unschedulable" pod_unschedulable
k get deploy,rs,pods -o wide

log "PASSED: etcd, kube-apiserver, kube-controller-manager, kube-scheduler from $BIN"
