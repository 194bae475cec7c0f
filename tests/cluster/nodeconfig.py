"""The test node's kubelet and kube-proxy configuration files, as pure builders.

Every setting that differs from the default says why: most follow from this
machine (cgroup v1 without systemd, no CAP_SYS_RESOURCE, disks that multi-GB
images fill) or from leaving the host as it was found (no sysctl changes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def kubelet_config(
    *,
    node_ip: str,
    port: int,
    healthz_port: int,
    ca_file: Path,
    runtime_socket: Path,
    pod_logs: Path,
    cgroup_root: str | None = None,
) -> dict[str, Any]:
    """The KubeletConfiguration of the test node; each setting says why it is there."""
    # A second kubelet on this host needs its own pod cgroup tree: each removes the
    # pod cgroups under its root that it does not know as orphans (nodelayout.py).
    root = {"cgroupRoot": cgroup_root} if cgroup_root else {}
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # The kubelet's API (logs, exec) on the bridge address only, where the
        # apiserver reaches it; a free port, so nothing else's 10250 matters.
        "address": node_ip,
        "port": port,
        "readOnlyPort": 0,  # no unauthenticated API
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        # Callers of that API prove who they are (the apiserver with its
        # kubelet-client cert) and are authorized by the apiserver (webhook).
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{runtime_socket}",
        # Host cgroups are v1 with no systemd to delegate to: cgroupfs, as runc is
        # told too (SystemdCgroup=false). v1 is deprecated, not refused, by default;
        # said explicitly so a changed default fails here first.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        **root,
        "failSwapOn": False,  # a developer machine may have swap; pods do not use it
        "podLogsDir": str(pod_logs),  # out of /var/log/pods, with the run directory
        # Any evictionHard entry zeroes the defaults not listed (mergeDefault...=false):
        # a disk that multi-GB images fill to 90% evicts nothing; only a really full
        # one (or memory) does.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        # 100 disables image GC: imported images cannot be pulled back.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        # Graceful node shutdown needs systemd-logind's inhibitor locks: none here.
        "shutdownGracePeriod": "0s",
        "shutdownGracePeriodCriticalPods": "0s",
        # No cluster DNS in this cluster: pods get this machine's resolv.conf.
        "resolvConf": "/etc/resolv.conf",
        # Status every 4 s (10 s by default): readiness and capacity show sooner.
        "nodeStatusUpdateFrequency": "4s",
        "nodeStatusReportFrequency": "1m",
        # The Lease is the heartbeat the node lifecycle controller reads: renewed every
        # quarter of this (2 s; 10 s by default), well inside the harness's shortened
        # grace before a node counts as lost (realcluster.NODE_MONITOR_GRACE_S).
        "nodeLeaseDurationSeconds": 8,
        "registerNode": True,
        "rotateCertificates": False,  # the test CA outlives the test
        "serverTLSBootstrap": False,  # a self-signed serving cert: the apiserver
        # does not verify kubelets unless told to (no --kubelet-certificate-authority)
    }


def kube_proxy_config(
    *, kubeconfig: Path, node_name: str, cluster_cidr: str, healthz_port: int, metrics_port: int
) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": node_name,
        "mode": "iptables",
        "clusterCIDR": cluster_cidr,
        "detectLocalMode": "ClusterCIDR",
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "iptables": {
            # SNAT everything sent to a Service IP: a pod reaching a Service whose
            # backend is on the same bridge then gets replies back through the host
            # even where bridged traffic skips iptables (no br_netfilter).
            "masqueradeAll": True,
            # No NodePorts on 127.0.0.1: that needs route_localnet, a host sysctl.
            "localhostNodePorts": False,
            "syncPeriod": "30s",
            "minSyncPeriod": "0s",  # every Service change is applied at once
        },
        "nodePortAddresses": ["primary"],  # NodePorts on the node's IP only
        # 0: leave the host's conntrack limits and timeouts (sysctls) as they are.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }
