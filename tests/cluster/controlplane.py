"""A real Kubernetes control plane for tests: etcd, kube-apiserver, controller-manager, scheduler.

The binaries are the real ones, built from the Kubernetes and etcd Go modules by
``tests/cluster/build.sh`` into a cache outside the repo. Everything listens on
127.0.0.1 on free ports with certificates made at start (a CA, the apiserver's
serving cert, an admin client cert in ``system:masters``, a service-account
signing key), RBAC and admission on. ``stop()`` leaves no process behind.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dpserve.plumbing.ports import free_ports

HERE = Path(__file__).resolve().parent
KUBECTL = os.environ.get("KUBECTL", shutil.which("kubectl") or "/usr/bin/kubectl")
SERVICE_CIDR = "10.96.0.0/24"  # the Services' cluster IPs


def build_binaries() -> Path:
    """The cached bin dir (builds on first use; a no-op afterwards)."""
    out = subprocess.run(
        ["bash", str(HERE / "build.sh")], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _sign(pki: Path, name: str, subject: str, extensions: str) -> None:
    _openssl(
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(pki / f"{name}.key"),
        "-out",
        str(pki / f"{name}.csr"),
        "-subj",
        subject,
    )
    (pki / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509",
        "-req",
        "-in",
        str(pki / f"{name}.csr"),
        "-CA",
        str(pki / "ca.crt"),
        "-CAkey",
        str(pki / "ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        str(pki / f"{name}.crt"),
        "-extfile",
        str(pki / f"{name}.ext"),
    )


CLIENT_EXTENSIONS = (
    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
)


def make_pki(pki: Path, api_ips: Sequence[str]) -> None:
    pki.mkdir(parents=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        str(pki / "ca.key"),
        "-out",
        str(pki / "ca.crt"),
        "-subj",
        "/CN=dpserve-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    sans = ",".join(
        [
            *(f"IP:{ip}" for ip in api_ips),
            "IP:10.96.0.1",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
        ]
    )
    server = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    _sign(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        f"{server}extendedKeyUsage=serverAuth\nsubjectAltName={sans}\n",
    )
    client = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    _sign(
        pki,
        "admin",
        "/O=system:masters/CN=kubernetes-admin",
        f"{client}extendedKeyUsage=clientAuth\n",
    )
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


class OnPlane:
    """kubeconfig, kubectl and env of a cluster built on one ControlPlane (``plane``)."""

    plane: ControlPlane | None

    @property
    def kubeconfig(self) -> Path:
        assert self.plane is not None, "the cluster is not running"
        return self.plane.kubeconfig

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        assert self.plane is not None, "the cluster is not running"
        return self.plane.kubectl(*args, check=check, input=input)

    def env(self) -> dict[str, str]:
        """This process's environment with KUBECONFIG pointing at the cluster."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}


@dataclass
class ControlPlane:
    bin: Path
    api_host: str = "127.0.0.1"
    components: tuple[str, ...] = ("controller-manager", "scheduler")
    # "lease" publishes the apiserver as the `kubernetes` Service's endpoint, which
    # pods behind kube-proxy need; it needs a routable api_host (not 127.0.0.1).
    endpoint_reconciler: str = "none"
    # A client cert for the apiserver's calls to kubelets (logs, exec, port-forward),
    # which real kubelets check; they are reached at their InternalIP.
    kubelet_client: bool = False
    # Seconds without a node's heartbeat before the node lifecycle controller marks
    # it NotReady (None: Kubernetes' default); a node-loss test waits on it.
    node_monitor_grace_s: int | None = None
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dpserve-k8s-")))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    def start(self) -> ControlPlane:
        etcd_port, peer_port, self.api_port, kcm_port, sched_port = free_ports(5)
        make_pki(self.pki, [self.api_host, "127.0.0.1"])
        kubelet_args: list[str] = []
        if self.kubelet_client:
            _sign(
                self.pki,
                "kubelet-client",
                "/O=system:masters/CN=kube-apiserver-kubelet-client",
                f"{CLIENT_EXTENSIONS}extendedKeyUsage=clientAuth\n",
            )
            kubelet_args = [
                f"--kubelet-client-certificate={self.pki / 'kubelet-client.crt'}",
                f"--kubelet-client-key={self.pki / 'kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP",
            ]
        self._write_kubeconfig()
        etcd = f"http://127.0.0.1:{etcd_port}"
        self._spawn(
            "etcd",
            [
                "--name=test",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls={etcd}",
                f"--advertise-client-urls={etcd}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self._wait(f"{etcd}/health", tls=False)
        p = self.pki
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={etcd}",
                f"--bind-address={self.api_host}",
                f"--advertise-address={self.api_host}",
                f"--secure-port={self.api_port}",
                f"--cert-dir={self.root / 'apiserver-certs'}",
                f"--tls-cert-file={p / 'apiserver.crt'}",
                f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={p / 'sa.pub'}",
                f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--endpoint-reconciler-type={self.endpoint_reconciler}",
                "--allow-privileged=true",
                *kubelet_args,
            ],
        )
        self._wait(f"{self.server}/readyz", tls=True)
        common = [
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
        ]
        if "controller-manager" in self.components:
            self._spawn(
                "kube-controller-manager",
                [
                    *common,
                    f"--secure-port={kcm_port}",
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={p / 'sa.key'}",
                    f"--root-ca-file={p / 'ca.crt'}",
                    f"--cluster-signing-cert-file={p / 'ca.crt'}",
                    f"--cluster-signing-key-file={p / 'ca.key'}",
                    # The HPA controller's loop (15 s by default) is what a test of
                    # an HPA waits on, three loops at least: a short one is the same
                    # controller, sooner.
                    "--horizontal-pod-autoscaler-sync-period=2s",
                    *self._node_monitor_args(),
                ],
            )
            self._wait(f"https://127.0.0.1:{kcm_port}/healthz", tls=False, verify=False)
        if "scheduler" in self.components:
            self._spawn("kube-scheduler", [*common, f"--secure-port={sched_port}"])
            self._wait(f"https://127.0.0.1:{sched_port}/healthz", tls=False, verify=False)
        return self

    def _node_monitor_args(self) -> list[str]:
        if self.node_monitor_grace_s is None:
            return []
        return [
            f"--node-monitor-grace-period={self.node_monitor_grace_s}s",
            "--node-monitor-period=1s",  # how often it looks (5 s by default)
        ]

    @property
    def server(self) -> str:
        return f"https://{self.api_host}:{self.api_port}"

    def client_kubeconfig(self, name: str, subject: str) -> Path:
        """A kubeconfig for a new client cert of ``subject`` (``/O=group/CN=user``),
        signed by the cluster's CA: how a kubelet or kube-proxy authenticates."""
        _sign(self.pki, name, subject, f"{CLIENT_EXTENSIONS}extendedKeyUsage=clientAuth\n")
        path = self.root / f"{name}.kubeconfig"

        def b64(file: str) -> str:
            return base64.b64encode((self.pki / file).read_bytes()).decode()

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    "cluster": {
                        "server": self.server,
                        "certificate-authority-data": b64("ca.crt"),
                    },
                }
            ],
            "users": [
                {
                    "name": name,
                    "user": {
                        "client-certificate-data": b64(f"{name}.crt"),
                        "client-key-data": b64(f"{name}.key"),
                    },
                }
            ],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": name}}],
            "current-context": "test",
        }
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML too
        return path

    def _write_kubeconfig(self) -> None:
        cfg = ["config", f"--kubeconfig={self.kubeconfig}"]
        self.kubectl(
            *cfg,
            "set-cluster",
            "test",
            f"--server={self.server}",
            f"--certificate-authority={self.pki / 'ca.crt'}",
            "--embed-certs=true",
        )
        self.kubectl(
            *cfg,
            "set-credentials",
            "admin",
            f"--client-certificate={self.pki / 'admin.crt'}",
            f"--client-key={self.pki / 'admin.key'}",
            "--embed-certs=true",
        )
        self.kubectl(*cfg, "set-context", "test", "--cluster=test", "--user=admin")
        self.kubectl(*cfg, "use-context", "test")

    def _spawn(self, name: str, args: list[str]) -> None:
        log = (self.root / f"{name}.log").open("wb")
        binary = self.bin / name
        self.procs[name] = subprocess.Popen(
            [str(binary), *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _wait(self, url: str, tls: bool, verify: bool = True, timeout_s: float = 120) -> None:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        if tls:
            context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        if not verify:  # components' self-signed serving certs
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited: {self.log_tail(dead[0])}")
            try:
                if httpx.get(url, verify=context, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{url} not healthy in {timeout_s}s")

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.root / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        cmd = [KUBECTL, *args]
        if not (args and args[0] == "config"):
            cmd.insert(1, f"--kubeconfig={self.kubeconfig}")
        return subprocess.run(cmd, check=check, capture_output=True, text=True, input=input)

    def stop(self) -> None:
        # One at a time, newest first: an apiserver whose etcd is already gone spends
        # its whole shutdown timeout retrying (seconds instead of ~1 s).
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
