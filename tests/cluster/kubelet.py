"""A test kubelet: pods bound to its Node run as local processes (a test double).

No container runtime and no images: each container's ``command`` + ``args`` runs
as a process on this machine, in the pod's own network namespace (an address on
the test bridge, see ``network.py``) and its own mount and UTS namespaces, where
``podexec.py`` bind-mounts the pod's volumes and execs the command. What an image
would bring is stood in for by ``image_mounts(image)`` (read-only binds, e.g. a
model directory at ``/models``) and ``image_env(image)``.

What it does, as a kubelet would, through the real apiserver:

* registers its Node (capacity = allocatable, InternalIP = the bridge address,
  Ready) and renews its Lease and Ready heartbeat every few seconds;
* one watch on pods with ``spec.nodeName=<node>``; per pod a worker thread that
  sets up the network and volumes (emptyDir, tmpfs for ``medium: Memory``,
  hostPath, configMap, secret, downwardAPI, projected with a TokenRequest token
  bound to the pod, PVC bound to a hostPath/local PV), resolves env (value,
  fieldRef, resourceFieldRef, secretKeyRef, configMapKeyRef, envFrom, ``$(VAR)``),
  runs init containers then containers, runs startup/readiness/liveness probes
  (exec via ``nsenter`` into the container, httpGet, tcpSocket), restarts per
  ``restartPolicy`` with exponential back-off (``CrashLoopBackOff``), and writes
  status (phase, conditions, container statuses, pod IP, host IP, start time)
  through the status subresource, only when it changed;
* on deletion: preStop hook, SIGTERM to each container's process group, SIGKILL
  after the grace period, tears the pod's namespace down, then deletes the pod
  object (grace 0, uid precondition);
* ``run_processes=False``: pods get an address and are reported Running and Ready
  at once, nothing is started (for scale tests of a controller).

The security context is honoured where a process can show it (``run_as_user``,
on by default): ``runAsUser``/``runAsGroup`` (the container's process and its exec
probes), ``fsGroup`` and ``supplementalGroups`` (extra groups; Secret, ConfigMap and
projected files are group-owned by ``fsGroup``), ``runAsNonRoot`` (a container that
would run as root is refused, ``CreateContainerConfigError``: without an image there
is no image user, so it needs a ``runAsUser``) and ``readOnlyRootFilesystem`` (the
host's ``/`` is read-only in the container's mount namespace; volumes stay as they
are). A non-root container still runs this machine's interpreter and repo: the
launcher masks ancestors it could not traverse (a root-only ``/root`` holding pyenv)
with a tmpfs that holds only the way down to them.

Differences from a real kubelet, on purpose: the processes run on the host file
system (no image root fs: writes outside volumes land on the host unless
``readOnlyRootFilesystem``). Capabilities and seccomp are not applied. No pid
namespace: a container is its process group, and at pod teardown everything left
in the pod's network namespace is killed. No resource limits, no cluster DNS and
no kube-proxy (Service IPs do not route; EndpointSlices hold real pod IPs). Not
supported: grpc probes, ephemeral containers, ``kubectl logs/exec`` (there is no
kubelet server: use ``pod_log()``), token rotation, ConfigMap/Secret volume
updates. The back-off starts at 1 s and caps at 30 s (a kubelet: 10 s, 300 s)
so tests stay quick.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import queue
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.cluster.network import NetworkError, PodNetwork, TestNetwork

log = logging.getLogger("dpserve.test-kubelet")

HERE = Path(__file__).resolve().parent
PODEXEC = HERE / "podexec.py"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TERMINAL = ("Succeeded", "Failed")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ROOT_PREFIX = "dpserve-kubelet-"

Json = dict[str, Any]


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_quantity(value: Any) -> float:
    """A Kubernetes quantity ("500m", "4Gi", "1e3", 2) as a float."""
    from kubernetes.utils import parse_quantity as parse

    return float(parse(str(value)))


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env[name] if name in env else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


class SetupError(RuntimeError):
    """A pod or container cannot start yet (missing ConfigMap, bad volume...): retried."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------- API access


class Api:
    """A small thread-safe JSON client for the apiserver, from a kubeconfig."""

    def __init__(self, kubeconfig: str | os.PathLike[str]) -> None:
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        self.server = cfg.host.rstrip("/")
        context = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
        if cfg.cert_file:
            context.load_cert_chain(cfg.cert_file, cfg.key_file)
        if not cfg.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        self.ca_pem = Path(cfg.ssl_ca_cert).read_text() if cfg.ssl_ca_cert else ""
        headers = {"Accept": "application/json"}
        token = cfg.api_key.get("authorization") or cfg.api_key.get("BearerToken")
        if token:
            headers["Authorization"] = token if token.startswith("Bearer ") else f"Bearer {token}"
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        self.http = httpx.Client(
            base_url=self.server, verify=context, headers=headers, timeout=30, limits=limits
        )
        self._watch_http = httpx.Client(base_url=self.server, verify=context, headers=headers)
        self._watch_response: httpx.Response | None = None
        self._watch_stopped = False

    def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Json:
        headers = {}
        if method == "PATCH":
            headers["Content-Type"] = "application/merge-patch+json"
        content = json.dumps(body) if body is not None else None
        if content is not None and "Content-Type" not in headers:
            headers["Content-Type"] = "application/json"
        r = self.http.request(method, path, content=content, headers=headers, **kw)
        if r.status_code >= 300:
            raise ApiError(r.status_code, r.text)
        return r.json() if r.content else {}

    def get(self, path: str, **params: Any) -> Json:
        return self.request("GET", path, params=params or None)

    def get_or_none(self, path: str) -> Json | None:
        try:
            return self.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def post(self, path: str, body: Json) -> Json:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Json) -> Json:
        return self.request("PATCH", path, body)

    def delete(self, path: str, body: Json | None = None) -> Json:
        return self.request("DELETE", path, body)

    def watch(self, path: str, **params: Any) -> Iterator[Json]:
        params = {**params, "watch": "1"}
        timeout = httpx.Timeout(10, read=float(params.get("timeoutSeconds", 300)) + 30)
        with self._watch_http.stream("GET", path, params=params, timeout=timeout) as r:
            if r.status_code != 200:
                raise ApiError(r.status_code, r.read().decode(errors="replace"))
            self._watch_response = r
            if self._watch_stopped:  # stop_watch() ran before the response existed
                return
            try:
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
            finally:
                self._watch_response = None

    def stop_watch(self) -> None:
        """Unblock a thread reading the watch (closing the response alone does not)."""
        self._watch_stopped = True
        response = self._watch_response
        if response is None:
            return
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stop_watch()
        self.http.close()
        self._watch_http.close()


class _Events:
    """Posts core/v1 Events from a queue, so workers never wait on them."""

    def __init__(self, api: Api, node: str) -> None:
        self.api, self.node = api, node
        self.q: queue.Queue[Json | None] = queue.Queue(maxsize=2000)
        self.thread = threading.Thread(target=self._run, name="kubelet-events", daemon=True)
        self.thread.start()

    def emit(self, pod: Json, kind: str, reason: str, message: str, container: str = "") -> None:
        meta = pod["metadata"]
        ref = {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": meta["namespace"],
            "name": meta["name"],
            "uid": meta["uid"],
        }
        if container:
            ref["fieldPath"] = f"spec.containers{{{container}}}"
        now = now_rfc3339()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                "namespace": meta["namespace"],
            },
            "involvedObject": ref,
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "kubelet", "host": self.node},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        with contextlib.suppress(queue.Full):
            self.q.put_nowait(event)

    def _run(self) -> None:
        while (event := self.q.get()) is not None:
            with contextlib.suppress(Exception):
                self.api.post(f"/api/v1/namespaces/{event['metadata']['namespace']}/events", event)

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self.q.put_nowait(None)
        self.thread.join(timeout=5)


# ---------------------------------------------------------------------- containers

WAITING, RUNNING, TERMINATED = "waiting", "running", "terminated"


@dataclass
class _Probe:
    kind: str
    spec: Json
    next_due: float = 0.0
    successes: int = 0
    failures: int = 0
    in_flight: bool = False

    def value(self, key: str, default: int) -> int:
        v = self.spec.get(key)
        return default if v is None else int(v)

    @property
    def period(self) -> float:
        return float(self.value("periodSeconds", 10))


@dataclass
class _Container:
    spec: Json
    init: bool = False
    sidecar: bool = False  # an init container with restartPolicy: Always
    state: str = WAITING
    reason: str = "ContainerCreating"
    message: str = ""
    proc: subprocess.Popen[bytes] | None = None  # the running process, None once reaped
    pid: int = 0
    exit_code: int | None = None  # set by the waiter when the process exits
    started_at: str = ""
    run_started: float = 0.0
    run_id: int = 0
    restart_count: int = 0
    backoff_n: int = 0
    next_start: float = 0.0
    terminated: Json | None = None
    last_terminated: Json | None = None
    ready: bool = False
    started: bool = False
    kill_reason: str = ""
    kill_deadline: float | None = None
    probes: dict[str, _Probe] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    warned_readiness: bool = False
    user: tuple[int | None, int | None] = (None, None)  # (uid, gid) exec probes run as

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def container_id(self) -> str:
        """The pid of the run (running or the last one) in a runtime-style URI."""
        return f"dpserve-test://{self.pid}" if self.pid else ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.exit_code is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)


@dataclass
class _Volume:
    path: Path
    read_only: bool = False
    tmpfs: bool = False


class _PodWorker:
    """One pod's life on this node, in its own thread."""

    def __init__(self, kubelet: TestKubelet, pod: Json) -> None:
        self.k = kubelet
        meta = pod["metadata"]
        self.uid, self.ns, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.pod = pod
        self.cond = threading.Condition()
        self.dirty = False
        self.gone = False  # the object is no longer in the API
        self.stopping = False  # the kubelet stops
        self.dir = kubelet.root / "pods" / f"{self.ns}_{self.name}_{self.uid}"
        self.log_dir = kubelet.root / "logs" / f"{self.ns}_{self.name}_{self.uid}"
        self.net: PodNetwork | None = None
        self.pod_ip = ""
        self.start_time = ""
        self.volumes: dict[str, _Volume] = {}
        self.setup_error: SetupError | None = None
        self.initialized = False
        self.terminal = pod.get("status", {}).get("phase") in TERMINAL
        self.phase = pod.get("status", {}).get("phase", "Pending")
        self.conditions: dict[str, Json] = {}
        self.last_status: Json | None = None
        self.report_retry: float | None = None
        spec = pod["spec"]
        self.init_ctrs = [
            _Container(c, init=True, sidecar=c.get("restartPolicy") == "Always")
            for c in spec.get("initContainers") or []
        ]
        self.main_ctrs = [_Container(c, reason="ContainerCreating") for c in spec["containers"]]
        if self.init_ctrs:
            for c in self.main_ctrs:
                c.reason = "PodInitializing"
        self.thread = threading.Thread(
            target=self._run, name=f"pod-{self.ns}/{self.name}", daemon=True
        )

    # -- called from other threads

    def kick(self) -> None:
        with self.cond:
            self.dirty = True
            self.cond.notify_all()

    def update(self, pod: Json) -> None:
        with self.cond:
            self.pod = pod
            self.dirty = True
            self.cond.notify_all()

    def mark_gone(self) -> None:
        with self.cond:
            self.gone = True
            self.dirty = True
            self.cond.notify_all()

    def shutdown(self) -> None:
        with self.cond:
            self.stopping = True
            self.dirty = True
            self.cond.notify_all()

    # -- helpers

    @property
    def all_ctrs(self) -> list[_Container]:
        return [*self.init_ctrs, *self.main_ctrs]

    @property
    def spec(self) -> Json:
        return self.pod["spec"]

    def _deleting(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp"))

    def _must_leave(self) -> bool:
        return self.gone or self.stopping or self._deleting()

    def _wait(self, timeout: float) -> None:
        with self.cond:
            if not self.dirty:
                self.cond.wait(max(0.0, timeout))
            self.dirty = False

    def _event(self, kind: str, reason: str, message: str, container: str = "") -> None:
        self.k._events.emit(self.pod, kind, reason, message, container)

    @property
    def hostname(self) -> str:
        name = self.spec.get("hostname") or self.name
        return name[:63].rstrip("-.")

    # -- the life of the pod

    def _run(self) -> None:
        try:
            self._main()
        except Exception:
            log.error("pod %s/%s: worker failed:\n%s", self.ns, self.name, traceback.format_exc())
        finally:
            try:
                self._cleanup()
            finally:
                self.k._worker_done(self)

    def _main(self) -> None:
        while self.net is None and not self.terminal and not self._must_leave():
            try:
                self.net = self.k.network.add_pod()
            except (NetworkError, OSError) as e:
                self._event("Warning", "FailedCreatePodSandBox", str(e))
                self._wait(2.0)
        if self.net is not None:
            self.pod_ip = self.net.ip
            self.start_time = now_rfc3339()
            self.dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._write_hosts()
            self._report()
            while not self._must_leave():
                try:
                    try:
                        self._prepare_volumes()
                    except (ApiError, httpx.HTTPError, OSError, subprocess.SubprocessError) as e:
                        raise SetupError("FailedMount", f"{type(e).__name__}: {e}") from e
                    self.setup_error = None
                    break
                except SetupError as e:
                    if self.setup_error is None or str(self.setup_error) != str(e):
                        self._event("Warning", e.reason, str(e))
                    self.setup_error = e
                    self._report()
                    self._wait(2.0)
        while True:
            with self.cond:
                gone, stopping, deleting = self.gone, self.stopping, self._deleting()
            if gone or stopping:
                fixed = 1.0 if gone else 2.0  # force-deleted, or the kubelet stops
                self._terminate(lambda fixed=fixed: fixed)
                return
            if deleting:
                self._terminate(self._grace)
                with self.cond:  # resources go before the object does
                    self._teardown_sandbox()
                self._delete_object()
                return
            with self.cond:
                now = time.monotonic()
                wake = self._step(now)
            self._report()
            if self.report_retry is not None:
                wake = min(wake, self.report_retry)
            self._wait(min(wake - time.monotonic(), 10.0))

    def _grace(self) -> float:
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.spec.get("terminationGracePeriodSeconds", 30)
        return float(grace)

    # -- the container state machine

    def _step(self, now: float) -> float:
        wake = now + 10.0
        if self.terminal or self.setup_error is not None:
            return now + (2.0 if self.setup_error else 60.0)
        for c in self.all_ctrs:
            if c.state == RUNNING and c.exit_code is not None:
                self._on_exit(c, now)
            if c.state == RUNNING and c.kill_deadline is not None:
                if now >= c.kill_deadline:
                    c.signal(signal.SIGKILL)
                    c.kill_deadline = None
                else:
                    wake = min(wake, c.kill_deadline)
        failed_init = False
        if not self.initialized:
            done = True
            for c in self.init_ctrs:
                if c.sidecar:
                    wake = min(wake, self._ensure_running(c, now))
                    if not c.started:
                        done = False
                        break
                    continue
                if c.state == TERMINATED:
                    if c.terminated and c.terminated["exitCode"] == 0:
                        continue
                    failed_init = True
                wake = min(wake, self._ensure_running(c, now))
                done = False
                break
            self.initialized = done
        if self.initialized:
            for c in self.init_ctrs:
                if c.sidecar:
                    wake = min(wake, self._ensure_running(c, now))
            for c in self.main_ctrs:
                wake = min(wake, self._ensure_running(c, now))
        for c in self.all_ctrs:
            if c.state == RUNNING and c.kill_deadline is None:
                wake = min(wake, self._schedule_probes(c, now))
        phase = self._phase(failed_init)
        if phase in TERMINAL and not self.terminal:
            self.terminal = True
            for c in self.all_ctrs:  # sidecars of a finished pod
                if c.state == RUNNING:
                    c.signal(signal.SIGTERM)
            self._wait_exits(deadline=time.monotonic() + 5)
            self._teardown_sandbox()
        self.phase = phase
        return wake

    def _ensure_running(self, c: _Container, now: float) -> float:
        if c.state != WAITING:
            return math.inf
        if now < c.next_start:
            return c.next_start
        try:
            try:
                self._start(c)
            except (ApiError, httpx.HTTPError, OSError, subprocess.SubprocessError) as e:
                raise SetupError("CreateContainerError", f"{type(e).__name__}: {e}") from e
        except SetupError as e:
            if c.reason != e.reason or c.message != str(e):
                self._event("Warning", "Failed", f"Error: {e}", c.name)
            c.reason, c.message = e.reason, str(e)
            c.next_start = now + 2.0
            return c.next_start
        return math.inf

    def _start(self, c: _Container) -> None:
        assert self.net is not None and self.net.netns
        env = self.k._container_env(self, c.spec)
        argv = [expand(a, env) for a in (c.spec.get("command") or []) + (c.spec.get("args") or [])]
        if not argv:
            raise SetupError(
                "CreateContainerError", "no command: the test kubelet has no image entrypoint"
            )
        mounts = self._mounts(c.spec, env)
        user: Json = {}
        pod_security: Json = {}
        if self.k.run_as_user:
            pod_security = self.spec.get("securityContext") or {}
            user = {**pod_security, **(c.spec.get("securityContext") or {})}
        if user.get("runAsNonRoot") and not user.get("runAsUser"):
            # A kubelet checks the image's user; here there is no image, so root it is.
            raise SetupError(
                "CreateContainerConfigError",
                f'container has runAsNonRoot and image will run as root (pod: "{self.name}", '
                f"container: {c.name})",
            )
        groups = [g for g in (pod_security.get("fsGroup"),) if g is not None]
        groups += list(pod_security.get("supplementalGroups") or [])
        launch = {
            "mounts": mounts,
            "hostname": self.hostname,
            "cwd": c.spec.get("workingDir") or "/",
            "argv": argv,
            "env": env,
            "uid": user.get("runAsUser"),
            "gid": user.get("runAsGroup"),
            "groups": groups,
            "read_only_root": bool(user.get("readOnlyRootFilesystem")),
            "parent": os.getpid(),
        }
        c.user = (user.get("runAsUser"), user.get("runAsGroup"))
        n = c.restart_count + (1 if c.run_id else 0)
        spec_path = self.dir / f"{c.name}-{n}.json"
        spec_path.write_text(json.dumps(launch))
        log_path = self.log_dir / c.name / f"{n}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            "ip", "netns", "exec", self.net.netns,
            "unshare", "--mount", "--uts", "--propagation", "private",
            sys.executable, str(PODEXEC), str(spec_path),
        ]  # fmt: skip
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"},
                cwd="/",
            )
        if c.run_id:
            c.restart_count += 1
        c.run_id += 1
        c.proc, c.pid, c.exit_code, c.env = proc, proc.pid, None, env
        c.state, c.reason, c.message = RUNNING, "", ""
        c.started_at = now_rfc3339()
        c.run_started = time.monotonic()
        c.kill_reason, c.kill_deadline = "", None
        c.warned_readiness = False
        c.probes = {
            kind: _Probe(
                kind,
                c.spec[kind],
                next_due=c.run_started + float(c.spec[kind].get("initialDelaySeconds") or 0),
            )
            for kind in PROBES
            if c.spec.get(kind) and not (c.init and not c.sidecar)
        }
        c.started = "startupProbe" not in c.probes
        c.ready = c.started and "readinessProbe" not in c.probes
        self.k._track(proc)
        threading.Thread(
            target=self._waiter, args=(c, proc), name=f"wait-{self.name}/{c.name}", daemon=True
        ).start()
        self._event("Normal", "Started", f"Started container {c.name}", c.name)

    def _waiter(self, c: _Container, proc: subprocess.Popen[bytes]) -> None:
        rc = proc.wait()
        # What the container left behind in its process group goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.k._untrack(proc)
        with self.cond:
            if c.proc is proc:
                c.exit_code = rc
            self.dirty = True
            self.cond.notify_all()

    def _on_exit(self, c: _Container, now: float) -> None:
        rc = c.exit_code
        assert rc is not None
        code = rc if rc >= 0 else 128 - rc
        term: Json = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": c.container_id,
        }
        if rc < 0:
            term["signal"] = -rc
        if code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            term["message"] = self._log_tail(c, 2048)
        c.proc, c.exit_code, c.ready, c.started, c.kill_deadline = None, None, False, False, None
        policy = "Always" if c.sidecar else self.spec.get("restartPolicy", "Always")
        if c.init and not c.sidecar and policy == "Always":
            policy = "OnFailure"  # init containers restart only on failure
        restart = not self._must_leave() and (
            policy == "Always" or (policy == "OnFailure" and code != 0)
        )
        if not restart:
            c.state, c.terminated = TERMINATED, term
            return
        if now - c.run_started > 2 * self.k.backoff_max_s:
            c.backoff_n = 0
        delay = (
            0.0
            if c.backoff_n == 0
            else min(self.k.backoff_max_s, self.k.backoff_base_s * 2 ** (c.backoff_n - 1))
        )
        c.backoff_n += 1
        c.last_terminated = term
        c.state, c.next_start = WAITING, now + delay
        c.reason = "CrashLoopBackOff"
        c.message = (
            f"back-off {delay:g}s restarting failed container={c.name} "
            f"pod={self.name}_{self.ns}({self.uid})"
        )
        if delay > 0:
            self._event("Warning", "BackOff", "Back-off restarting failed container", c.name)

    def _log_tail(self, c: _Container, limit: int) -> str:
        n = c.restart_count
        path = self.log_dir / c.name / f"{n}.log"
        try:
            data = path.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode(errors="replace")

    # -- probes

    def _schedule_probes(self, c: _Container, now: float) -> float:
        wake = math.inf
        for kind, p in c.probes.items():
            if (kind == "startupProbe") == c.started or p.in_flight:
                continue
            if now >= p.next_due:
                p.in_flight = True
                self.k._probe_pool.submit(self._probe, c, p, c.run_id)
            else:
                wake = min(wake, p.next_due)
        return wake

    def _probe(self, c: _Container, p: _Probe, run_id: int) -> None:
        try:
            ok, detail = self.k._run_probe(self, c, p.spec)
        except Exception as e:  # a probe that cannot run fails
            ok, detail = False, f"{type(e).__name__}: {e}"
        with self.cond:
            p.in_flight = False
            if c.run_id != run_id or c.state != RUNNING or c.kill_deadline is not None:
                return
            now = time.monotonic()
            p.next_due = now + p.period
            if ok:
                p.successes, p.failures = p.successes + 1, 0
            else:
                p.successes, p.failures = 0, p.failures + 1
            if p.kind == "startupProbe":
                if ok:
                    c.started = True
                    c.ready = "readinessProbe" not in c.probes
                    for other in c.probes.values():
                        other.next_due = max(other.next_due, now)
                elif p.failures >= p.value("failureThreshold", 3):
                    self._probe_kill(c, p, detail)
            elif p.kind == "readinessProbe":
                if ok and p.successes >= p.value("successThreshold", 1):
                    c.ready = True
                elif not ok and p.failures >= p.value("failureThreshold", 3):
                    if c.ready or not c.warned_readiness:
                        self._event(
                            "Warning", "Unhealthy", f"Readiness probe failed: {detail}", c.name
                        )
                        c.warned_readiness = True
                    c.ready = False
            elif not ok and p.failures >= p.value("failureThreshold", 3):
                self._probe_kill(c, p, detail)
            self.dirty = True
            self.cond.notify_all()

    def _probe_kill(self, c: _Container, p: _Probe, detail: str) -> None:
        what = "Liveness" if p.kind == "livenessProbe" else "Startup"
        self._event("Warning", "Unhealthy", f"{what} probe failed: {detail}", c.name)
        self._event(
            "Normal",
            "Killing",
            f"Container {c.name} failed {what.lower()} probe, will be restarted",
            c.name,
        )
        grace = p.spec.get("terminationGracePeriodSeconds")
        if grace is None:
            grace = self.spec.get("terminationGracePeriodSeconds", 30)
        c.kill_reason = p.kind
        c.ready = False
        c.signal(signal.SIGTERM)
        c.kill_deadline = time.monotonic() + float(grace)

    # -- termination

    def _wait_exits(self, deadline: float, grace: Callable[[], float] | None = None) -> bool:
        """Wait until no container runs (True) or the deadline passes (False)."""
        while True:
            with self.cond:
                running = [c for c in self.all_ctrs if c.proc is not None and c.exit_code is None]
                if not running:
                    return True
                if grace is not None:
                    deadline = min(deadline, self._terminate_started + grace())
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))

    def _terminate(self, grace: Callable[[], float]) -> None:
        self._terminate_started = time.monotonic()
        running = [c for c in self.all_ctrs if c.proc is not None and c.exit_code is None]
        if not running:
            return
        hooks = [c for c in running if (c.spec.get("lifecycle") or {}).get("preStop")]
        if hooks and grace() > 0:
            futures = [self.k._probe_pool.submit(self._pre_stop, c) for c in hooks]
            for f in futures:
                with contextlib.suppress(Exception):
                    f.result(timeout=max(0.0, self._terminate_started + grace() - time.monotonic()))
        for c in running:
            self._event("Normal", "Killing", f"Stopping container {c.name}", c.name)
            c.signal(signal.SIGTERM)
        if not self._wait_exits(math.inf, grace):
            for c in running:
                c.signal(signal.SIGKILL)
            self._wait_exits(time.monotonic() + 10)

    def _pre_stop(self, c: _Container) -> None:
        hook = c.spec["lifecycle"]["preStop"]
        deadline = self._terminate_started + self._grace()
        if "sleep" in hook:
            time.sleep(
                max(0.0, min(float(hook["sleep"].get("seconds", 0)), deadline - time.monotonic()))
            )
            return
        spec = {**hook, "timeoutSeconds": max(1, int(deadline - time.monotonic()))}
        self.k._run_probe(self, c, spec)

    def _delete_object(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        try:
            self.k.api.delete(f"/api/v1/namespaces/{self.ns}/pods/{self.name}", body)
        except ApiError as e:
            if e.status not in (404, 409):
                log.warning("pod %s/%s: delete failed: %s", self.ns, self.name, e)

    def _teardown_sandbox(self) -> None:
        if self.net is None:
            return
        self.k.network.remove_pod(self.net)  # also kills what escaped the process groups
        self.net = None

    def _cleanup(self) -> None:
        for c in self.all_ctrs:
            c.signal(signal.SIGKILL)
        self._wait_exits(time.monotonic() + 10)
        self._teardown_sandbox()
        for v in self.volumes.values():
            if v.tmpfs:
                subprocess.run(["umount", "-l", str(v.path)], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- status

    def _set_condition(self, kind: str, ok: bool, reason: str = "", message: str = "") -> None:
        status = "True" if ok else "False"
        prev = self.conditions.get(kind)
        cond: Json = {
            "type": kind,
            "status": status,
            "lastTransitionTime": prev["lastTransitionTime"]
            if prev and prev["status"] == status
            else now_rfc3339(),
        }
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        self.conditions[kind] = cond

    def _phase(self, failed_init: bool = False) -> str:
        if self.phase in TERMINAL:
            return self.phase
        policy = self.spec.get("restartPolicy", "Always")
        if failed_init and policy == "Never":
            return "Failed"
        if not self.initialized:
            return "Pending"
        ctrs = self.main_ctrs
        waiting = sum(1 for c in ctrs if c.state == WAITING and c.last_terminated is None)
        running = sum(1 for c in ctrs if c.state == RUNNING)
        stopped = len(ctrs) - waiting - running
        succeeded = sum(
            1
            for c in ctrs
            if c.state == TERMINATED and c.terminated and c.terminated["exitCode"] == 0
        )
        if waiting:
            return "Pending"
        if running:
            return "Running"
        if stopped == len(ctrs):
            if any(c.state == WAITING for c in ctrs):  # restarting
                return "Running"
            if succeeded == len(ctrs):
                return "Succeeded"
            return "Failed"
        return "Running"

    def _ctr_status(self, c: _Container) -> Json:
        if c.state == RUNNING:
            state: Json = {"running": {"startedAt": c.started_at}}
        elif c.state == TERMINATED and c.terminated is not None:
            state = {"terminated": c.terminated}
        else:
            reason = c.reason
            if self.setup_error is not None:
                reason = "ContainerCreating"
            state = {"waiting": {"reason": reason, **({"message": c.message} if c.message else {})}}
        out: Json = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "",
            "ready": c.ready and c.state == RUNNING,
            "started": c.started and c.state == RUNNING,
            "restartCount": c.restart_count,
            "state": state,
            "lastState": {"terminated": c.last_terminated} if c.last_terminated else {},
        }
        if c.state == RUNNING:
            out["containerID"] = c.container_id
        return out

    def _status(self) -> Json:
        terminal = self.phase in TERMINAL
        self._set_condition("PodReadyToStartContainers", self.net is not None or terminal)
        if self.initialized or terminal:
            self._set_condition("Initialized", True)
        else:
            pending = [c.name for c in self.init_ctrs if not (c.sidecar and c.started)]
            self._set_condition(
                "Initialized",
                False,
                "ContainersNotInitialized",
                f"containers with incomplete status: [{' '.join(pending)}]",
            )
        unready = [
            c.name
            for c in self.main_ctrs + [s for s in self.init_ctrs if s.sidecar]
            if not (c.ready and c.state == RUNNING)
        ]
        if terminal:
            self._set_condition("ContainersReady", False, "PodCompleted")
            self._set_condition("Ready", False, "PodCompleted")
        elif unready:
            message = f"containers with unready status: [{' '.join(unready)}]"
            self._set_condition("ContainersReady", False, "ContainersNotReady", message)
            self._set_condition("Ready", False, "ContainersNotReady", message)
        else:
            self._set_condition("ContainersReady", True)
            self._set_condition("Ready", True)
        ours = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")
        foreign = [
            cond
            for cond in self.pod.get("status", {}).get("conditions") or []
            if cond.get("type") not in ours
        ]
        status: Json = {
            "phase": self.phase,
            "conditions": [self.conditions[t] for t in ours] + foreign,
            "hostIP": self.k.host_ip,
            "hostIPs": [{"ip": self.k.host_ip}],
            "containerStatuses": [self._ctr_status(c) for c in self.main_ctrs],
        }
        if self.init_ctrs:
            status["initContainerStatuses"] = [self._ctr_status(c) for c in self.init_ctrs]
        if self.pod_ip:
            status["podIP"] = self.pod_ip
            status["podIPs"] = [{"ip": self.pod_ip}]
        if self.start_time:
            status["startTime"] = self.start_time
        if self.setup_error is not None:
            status["message"] = str(self.setup_error)
            status["reason"] = self.setup_error.reason
        return status

    def _report(self) -> None:
        if self.gone or not self.start_time:  # nothing of ours to say yet (or any more)
            return
        with self.cond:
            status = self._status()
        if status == self.last_status and self.report_retry is None:
            return
        try:
            self.k.api.patch(
                f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status", {"status": status}
            )
            self.last_status, self.report_retry = status, None
        except ApiError as e:
            if e.status == 404:
                self.gone = True
                return
            log.warning("pod %s/%s: status update failed: %s", self.ns, self.name, e)
            self.report_retry = time.monotonic() + 1.0
        except httpx.HTTPError as e:
            log.warning("pod %s/%s: status update failed: %s", self.ns, self.name, e)
            self.report_retry = time.monotonic() + 1.0

    # -- files: /etc/hosts, volumes, mounts

    def _write_hosts(self) -> None:
        lines = [
            "# Kubernetes-managed hosts file (dpserve test kubelet).",
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
        ]
        sub = self.spec.get("subdomain")
        names = [self.hostname]
        if sub:
            names.insert(0, f"{self.hostname}.{sub}.{self.ns}.svc.cluster.local")
        lines.append(f"{self.pod_ip}\t{' '.join(names)}")
        for alias in self.spec.get("hostAliases") or []:
            lines.append(f"{alias['ip']}\t{' '.join(alias.get('hostnames') or [])}")
        (self.dir / "hosts").write_text("\n".join(lines) + "\n")

    def _prepare_volumes(self) -> None:
        vols = list(self.spec.get("volumes") or [])
        if (
            not any("serviceAccountToken" in str(v.get("projected", "")) for v in vols)
            and self.spec.get("automountServiceAccountToken") is not False
        ):
            # The ServiceAccount admission plugin adds this volume; do it if it did not.
            vols.append({"name": "kube-api-access-kubelet", "projected": _sa_sources()})
            for c in self.all_ctrs:
                mounts = c.spec.setdefault("volumeMounts", [])
                if not any(m.get("mountPath") == SA_MOUNT for m in mounts):
                    mounts.append(
                        {"name": "kube-api-access-kubelet", "mountPath": SA_MOUNT, "readOnly": True}
                    )
        for v in vols:
            name = v["name"]
            if name in self.volumes:
                continue
            self.volumes[name] = self.k._make_volume(self, v, self.dir / "volumes" / name)

    def _mounts(self, spec: Json, env: dict[str, str]) -> list[Json]:
        mounts: list[Json] = []
        image = spec.get("image", "")
        for target, source in (self.k.image_mounts(image) if self.k.image_mounts else {}).items():
            src = Path(source)
            mounts.append(
                {
                    "type": "bind",
                    "source": str(src),
                    "target": target,
                    "readOnly": True,
                    "file": src.is_file(),
                }
            )
        for vm in spec.get("volumeMounts") or []:
            vol = self.volumes.get(vm["name"])
            if vol is None:
                raise SetupError("CreateContainerConfigError", f"volume {vm['name']!r} not found")
            src = vol.path
            sub = vm.get("subPath") or (
                expand(vm["subPathExpr"], env) if vm.get("subPathExpr") else ""
            )
            if sub:
                src = src / sub
                if not src.exists():
                    src.mkdir(parents=True, mode=0o777)
            mounts.append(
                {
                    "type": "bind",
                    "source": str(src),
                    "target": vm["mountPath"],
                    "readOnly": bool(vm.get("readOnly") or vol.read_only),
                    "file": src.is_file(),
                }
            )
        if not any(m["target"] == "/etc/hosts" for m in mounts):
            mounts.append(
                {
                    "type": "bind",
                    "source": str(self.dir / "hosts"),
                    "target": "/etc/hosts",
                    "file": True,
                }
            )
        # Parents before children; a later mount at the same path wins (volumes over image).
        mounts.sort(key=lambda m: len(Path(m["target"]).parts))
        targets = [m["target"] for m in mounts]
        for m in mounts:
            inside_other = any(
                t != m["target"] and Path(m["target"]).is_relative_to(t) for t in targets
            )
            if not inside_other:
                self.k._ensure_mount_point(m["target"], m["file"])
        return mounts


def _sa_sources() -> Json:
    return {
        "defaultMode": 0o644,
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {
                "configMap": {
                    "name": "kube-root-ca.crt",
                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                }
            },
            {
                "downwardAPI": {
                    "items": [
                        {
                            "path": "namespace",
                            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                        }
                    ]
                }
            },
        ],
    }


# ---------------------------------------------------------------------- the kubelet


class TestKubelet:
    """Registers a Node and runs the pods the scheduler binds to it (see module doc)."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        kubeconfig: str | os.PathLike[str],
        node_name: str = "node-1",
        capacity: dict[str, str] | None = None,
        network: TestNetwork | None = None,
        api: tuple[str, int] | None = None,
        path_prefix: list[str] | None = None,
        image_mounts: Callable[[str], dict[str, str | os.PathLike[str]]] | None = None,
        run_processes: bool = True,
        *,
        image_env: Callable[[str], dict[str, str]] | None = None,
        labels: dict[str, str] | None = None,
        taints: list[Json] | None = None,
        root: str | os.PathLike[str] | None = None,
        heartbeat_s: float = 5.0,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 30.0,
        run_as_user: bool = True,
    ) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.node_name = node_name
        self.capacity = dict(
            capacity or {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "4"}
        )
        if network is None:
            if run_processes:
                raise ValueError("a TestKubelet that runs processes needs a started TestNetwork")
            network = TestNetwork()  # an address pool only: nothing is set up
        self.network = network
        self.host_ip = network.gateway
        self._api_endpoint = api
        self.path_prefix = [str(p) for p in (path_prefix or [str(Path(sys.executable).parent)])]
        self.image_mounts = image_mounts
        self.image_env = image_env
        self.run_processes = run_processes
        self.labels = labels or {}
        self.taints = taints or []
        self._root_arg = Path(root) if root else None
        self.heartbeat_s = heartbeat_s
        self.watch_timeout_s = 240  # the apiserver ends a watch after this; it is renewed
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.run_as_user = run_as_user
        self.root = Path()
        self._lock = threading.Lock()
        self._workers: dict[str, _PodWorker] = {}
        self._finished: set[str] = set()
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._made_dirs: list[str] = []
        self._fake_ips: dict[str, str] = {}
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._threads: list[threading.Thread] = []
        self.api: Api
        self.node_uid = ""
        self._node_since = now_rfc3339()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> TestKubelet:
        _cleanup_stale_roots()
        self.root = self._root_arg or Path(tempfile.mkdtemp(prefix=ROOT_PREFIX))
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "kubelet.pid").write_text(str(os.getpid()))
        self.api = Api(self.kubeconfig)
        if self._api_endpoint is None:
            url = urlsplit(self.api.server)
            self._api_endpoint = (url.hostname or "127.0.0.1", url.port or 443)
        if self.run_processes and self._api_endpoint[0].startswith("127."):
            log.warning("the apiserver is on loopback: pods cannot reach it from their namespaces")
        self._events = _Events(self.api, self.node_name)
        self._probe_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kubelet-probe")
        self._fake_pools = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kubelet-fake{i}")
            for i in range(4)
        ]
        self._probe_http = httpx.Client(
            verify=False, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self._register_node()
        for target, name in (
            (self._heartbeat, "kubelet-heartbeat"),
            (self._watch, "kubelet-watch"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if not self._synced.wait(30):
            raise TimeoutError("the test kubelet could not list its pods")
        return self

    def stop(self) -> None:
        self._stop.set()
        if not hasattr(self, "api"):
            return
        self.api.stop_watch()
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.shutdown()
        for w in workers:
            w.thread.join(timeout=20)
        for pool in self._fake_pools:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            procs = list(self._procs)
        for proc in procs:  # whatever a stuck worker left
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for ip in list(self._fake_ips.values()):
            self.network.release_ip(ip)
        self._fake_ips.clear()
        for path in (
            f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node_name}",
            f"/api/v1/nodes/{self.node_name}",
        ):
            with contextlib.suppress(Exception):
                self.api.delete(path)
        for t in self._threads:
            t.join(timeout=5)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        self._events.close()
        self._probe_http.close()
        self.api.close()
        _remove_root(self.root, self._made_dirs)

    def __enter__(self) -> TestKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def api_endpoint(self) -> tuple[str, int]:
        assert self._api_endpoint is not None
        return self._api_endpoint

    # ------------------------------------------------------------------ debugging

    def pod_log(
        self,
        name: str,
        namespace: str = "default",
        container: str | None = None,
        previous: bool = False,
    ) -> str:
        """A container's output (the newest pod of that name; ``previous``: the run before)."""
        dirs = sorted(
            (self.root / "logs").glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime
        )
        if not dirs:
            return ""
        ctrs = sorted(p for p in dirs[-1].iterdir() if p.is_dir())
        if not ctrs:
            return ""
        cdir = next((p for p in ctrs if p.name == container), None) if container else ctrs[0]
        if cdir is None:
            return ""
        runs = sorted((int(p.stem) for p in cdir.glob("*.log")), reverse=True)
        index = 1 if previous else 0
        if len(runs) <= index:
            return ""
        return (cdir / f"{runs[index]}.log").read_text(errors="replace")

    def describe(self) -> str:
        """Every pod's containers and the tail of their logs: for a failing test's message."""
        out = []
        for pod_dir in sorted((self.root / "logs").glob("*")):
            for cdir in sorted(pod_dir.iterdir()):
                for f in sorted(cdir.glob("*.log"), key=lambda p: int(p.stem)):
                    tail = f.read_text(errors="replace")[-1500:]
                    out.append(f"--- {pod_dir.name} {cdir.name} run {f.stem}\n{tail}")
        return "\n".join(out)

    # ------------------------------------------------------------------ node

    def _node_status(self) -> Json:
        now = now_rfc3339()
        conds = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        ]
        return {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "addresses": [
                {"type": "InternalIP", "address": self.host_ip},
                {"type": "Hostname", "address": self.node_name},
            ],
            "conditions": [
                {
                    "type": t,
                    "status": s,
                    "reason": r,
                    "message": "dpserve test kubelet",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": self._node_since,
                }
                for t, s, r in conds
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": self.node_name,
                "systemUUID": self.node_name,
                "bootID": self.node_name,
                "kernelVersion": os.uname().release,
                "osImage": "dpserve test kubelet",
                "containerRuntimeVersion": "dpserve-test://0",
                "kubeletVersion": "v0.0.0-dpserve-test",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }

    def _register_node(self) -> None:
        labels = {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            **self.labels,
        }
        subnet = str(self.network.subnet)
        spec: Json = {"podCIDR": subnet, "podCIDRs": [subnet]}
        if self.taints:
            spec["taints"] = self.taints
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.node_name, "labels": labels},
            "spec": spec,
            "status": self._node_status(),
        }
        try:
            created = self.api.post("/api/v1/nodes", node)
        except ApiError as e:
            if e.status != 409:
                raise
            created = self.api.patch(
                f"/api/v1/nodes/{self.node_name}", {"metadata": {"labels": labels}, "spec": spec}
            )
        self.node_uid = created["metadata"]["uid"]
        self.api.patch(f"/api/v1/nodes/{self.node_name}/status", {"status": self._node_status()})
        self._renew_lease()

    def _renew_lease(self) -> None:
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        try:
            self.api.patch(
                f"{path}/{self.node_name}",
                {"spec": {"holderIdentity": self.node_name, "renewTime": now_micro()}},
            )
        except ApiError as e:
            if e.status != 404:
                raise
            owner = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.node_name,
                "uid": self.node_uid,
            }
            self.api.post(
                path,
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": self.node_name,
                        "namespace": "kube-node-lease",
                        "ownerReferences": [owner],
                    },
                    "spec": {
                        "holderIdentity": self.node_name,
                        "leaseDurationSeconds": 40,
                        "renewTime": now_micro(),
                    },
                },
            )

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._renew_lease()
                self.api.patch(
                    f"/api/v1/nodes/{self.node_name}/status",
                    {"status": {"conditions": self._node_status()["conditions"]}},
                )
            except Exception as e:
                if not self._stop.is_set():
                    log.warning("node heartbeat failed: %s", e)

    # ------------------------------------------------------------------ pods

    def _watch(self) -> None:
        rv = ""
        selector = f"spec.nodeName={self.node_name}"
        while not self._stop.is_set():
            try:
                if not rv:
                    listed = self.api.get("/api/v1/pods", fieldSelector=selector)
                    rv = listed["metadata"]["resourceVersion"]
                    self._relist(listed["items"])
                    self._synced.set()
                for event in self.api.watch(
                    "/api/v1/pods",
                    fieldSelector=selector,
                    resourceVersion=rv,
                    allowWatchBookmarks="true",
                    timeoutSeconds=self.watch_timeout_s,
                ):
                    if self._stop.is_set():
                        return
                    kind, obj = event["type"], event["object"]
                    if kind == "ERROR":
                        rv = "" if obj.get("code") == 410 else rv
                        break
                    rv = obj["metadata"].get("resourceVersion", rv)
                    if kind != "BOOKMARK":
                        self._dispatch(kind, obj)
            except ApiError as e:
                if e.status == 410:
                    rv = ""
                elif not self._stop.is_set():
                    log.warning("pod watch: %s", e)
                    self._stop.wait(0.5)
            except Exception as e:
                if self._stop.is_set():
                    return
                log.warning("pod watch: %s: %s", type(e).__name__, e)
                self._stop.wait(0.5)

    def _relist(self, pods: list[Json]) -> None:
        present = {p["metadata"]["uid"] for p in pods}
        with self._lock:
            known = set(self._workers) | set(self._fake_ips)
            self._finished &= present
        for uid in known - present:
            self._dispatch("DELETED", {"metadata": {"uid": uid}})
        for pod in pods:
            self._dispatch("MODIFIED", pod)

    def _dispatch(self, kind: str, pod: Json) -> None:
        uid = pod["metadata"]["uid"]
        if not self.run_processes:
            shard = self._fake_pools[hash(uid) % len(self._fake_pools)]
            shard.submit(self._fake_handle, kind, pod)
            return
        # Lock order: a worker's condition, then the kubelet's lock; never the reverse,
        # so workers are only called with the kubelet's lock released.
        new = False
        with self._lock:
            worker = self._workers.get(uid)
            if kind == "DELETED":
                self._finished.discard(uid)
            elif worker is None and uid not in self._finished and not self._stop.is_set():
                worker, new = _PodWorker(self, pod), True
                self._workers[uid] = worker
        if worker is None:
            return
        if kind == "DELETED":
            worker.mark_gone()
        elif new:
            worker.thread.start()
        else:
            worker.update(pod)

    def _worker_done(self, worker: _PodWorker) -> None:
        with self._lock:
            self._workers.pop(worker.uid, None)
            if not worker.gone:
                self._finished.add(worker.uid)

    def _track(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.add(proc)

    def _untrack(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._procs.discard(proc)

    # -- run_processes=False

    def _fake_handle(self, kind: str, pod: Json) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        try:
            if kind == "DELETED":
                with self._lock:
                    ip = self._fake_ips.pop(uid, None)
                if ip:
                    self.network.release_ip(ip)
                return
            if meta.get("deletionTimestamp"):
                body = {
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": uid},
                }
                with contextlib.suppress(ApiError):
                    self.api.delete(
                        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body
                    )
                return
            with self._lock:
                if uid in self._fake_ips or self._stop.is_set():
                    return
            if pod.get("status", {}).get("phase") in TERMINAL:
                return
            ip = self.network.allocate_ip()
            with self._lock:
                self._fake_ips[uid] = ip
            now = now_rfc3339()
            conds = [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")
            ]
            foreign = [
                c
                for c in pod.get("status", {}).get("conditions") or []
                if c["type"] == "PodScheduled"
            ]
            status = {
                "phase": "Running",
                "conditions": conds + foreign,
                "hostIP": self.host_ip,
                "hostIPs": [{"ip": self.host_ip}],
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": now,
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c.get("image", ""),
                        "imageID": "",
                        "ready": True,
                        "started": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": now}},
                    }
                    for c in pod["spec"]["containers"]
                ],
            }
            self.api.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": status},
            )
        except Exception as e:
            if not self._stop.is_set():
                log.warning("pod %s/%s: %s", meta.get("namespace"), meta.get("name"), e)

    # -- env, volumes, probes (used by workers)

    def _field(self, w: _PodWorker, path: str) -> str:
        pod = w.pod
        meta = pod["metadata"]
        simple = {
            "metadata.name": meta["name"],
            "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"],
            "spec.nodeName": pod["spec"].get("nodeName", self.node_name),
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
            "status.podIP": w.pod_ip,
            "status.podIPs": w.pod_ip,
            "status.hostIP": self.host_ip,
            "status.hostIPs": self.host_ip,
        }
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)(?:\['(.+)'\])?", path)
        if m:
            values = meta.get(m.group(1)) or {}
            if m.group(2) is not None:
                return str(values.get(m.group(2), ""))
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        raise SetupError("CreateContainerConfigError", f"unsupported fieldRef {path!r}")

    def _resource_field(self, w: _PodWorker, ref: Json, default_container: Json | None) -> str:
        name = ref.get("containerName")
        ctr = default_container
        if name:
            ctr = next((c for c in w.spec["containers"] if c["name"] == name), None)
        kind, _, res = ref["resource"].partition(".")
        value = ((ctr or {}).get("resources") or {}).get(kind, {}).get(res)
        if value is None and kind == "requests":
            value = ((ctr or {}).get("resources") or {}).get("limits", {}).get(res)
        if value is None:
            value = self.capacity.get(res, "0")
        divisor = parse_quantity(ref.get("divisor") or "1")
        return str(math.ceil(parse_quantity(value) / divisor))

    def _key_ref(self, ns: str, kind: str, ref: Json) -> str | None:
        obj = self._get_data_object(ns, kind, ref["name"], bool(ref.get("optional")))
        if obj is None:
            return None
        data = obj.get("data") or {}
        key = ref["key"]
        if key in data:
            return base64.b64decode(data[key]).decode() if kind == "secrets" else data[key]
        if kind == "configmaps" and key in (obj.get("binaryData") or {}):
            return base64.b64decode(obj["binaryData"][key]).decode(errors="replace")
        if ref.get("optional"):
            return None
        raise SetupError(
            "CreateContainerConfigError",
            f"couldn't find key {key} in {kind[:-1]} {ns}/{ref['name']}",
        )

    def _get_data_object(self, ns: str, kind: str, name: str, optional: bool) -> Json | None:
        obj = self.api.get_or_none(f"/api/v1/namespaces/{ns}/{kind}/{name}")
        if obj is None and not optional:
            raise SetupError("CreateContainerConfigError", f'{kind[:-1]} "{name}" not found')
        return obj

    def _container_env(self, w: _PodWorker, spec: Json) -> dict[str, str]:
        host, port = self.api_endpoint
        env: dict[str, str] = {
            "PATH": os.pathsep.join([*self.path_prefix, os.environ.get("PATH", SYSTEM_PATH)]),
            "HOME": os.environ.get("HOME", "/root"),
            "HOSTNAME": w.hostname,
            "LANG": os.environ.get("LANG", "C.UTF-8"),
        }
        if self.image_env:
            env.update(self.image_env(spec.get("image", "")))
        env.update(
            {
                "KUBERNETES_SERVICE_HOST": host,
                "KUBERNETES_SERVICE_PORT": str(port),
                "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
                "KUBERNETES_PORT": f"tcp://{host}:{port}",
                "KUBERNETES_PORT_443_TCP": f"tcp://{host}:{port}",
                "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
                "KUBERNETES_PORT_443_TCP_ADDR": host,
                "KUBERNETES_PORT_443_TCP_PORT": str(port),
            }
        )
        for src in spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
                if key not in src:
                    continue
                ref = src[key]
                obj = self._get_data_object(w.ns, kind, ref["name"], bool(ref.get("optional")))
                for k, v in ((obj or {}).get("data") or {}).items():
                    env[prefix + k] = base64.b64decode(v).decode() if kind == "secrets" else v
        for item in spec.get("env") or []:
            name = item["name"]
            if "valueFrom" not in item:
                env[name] = expand(item.get("value", ""), env)
                continue
            src = item["valueFrom"]
            value: str | None
            if "fieldRef" in src:
                value = self._field(w, src["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in src:
                value = self._resource_field(w, src["resourceFieldRef"], spec)
            elif "secretKeyRef" in src:
                value = self._key_ref(w.ns, "secrets", src["secretKeyRef"])
            elif "configMapKeyRef" in src:
                value = self._key_ref(w.ns, "configmaps", src["configMapKeyRef"])
            else:
                raise SetupError("CreateContainerConfigError", f"unsupported env source for {name}")
            if value is not None:
                env[name] = value
        return env

    def _ensure_mount_point(self, target: str, is_file: bool) -> None:
        """Make a mount point on the host (no image root fs), remembering what it made."""
        path = Path(target)
        if os.path.lexists(path):
            return
        missing = []
        p = path if not is_file else path.parent
        while not os.path.lexists(p):
            missing.append(p)
            p = p.parent
        with self._lock:
            for d in reversed(missing):
                with contextlib.suppress(FileExistsError):
                    d.mkdir()
                    self._made_dirs.append(str(d))
            if is_file and not os.path.lexists(path):
                path.touch()
                self._made_dirs.append(str(path))
            (self.root / "made-dirs.json").write_text(json.dumps(self._made_dirs))

    def _token(self, w: _PodWorker, source: Json) -> str:
        sa = w.spec.get("serviceAccountName") or "default"
        spec: Json = {
            "expirationSeconds": int(source.get("expirationSeconds") or 3600),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": w.name, "uid": w.uid},
        }
        if source.get("audience"):
            spec["audiences"] = [source["audience"]]
        try:
            out = self.api.post(
                f"/api/v1/namespaces/{w.ns}/serviceaccounts/{sa}/token",
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
            )
        except ApiError as e:
            raise SetupError("FailedMount", f"token for service account {w.ns}/{sa}: {e}") from e
        return str(out["status"]["token"])

    def _data_files(self, w: _PodWorker, kind: str, src: Json) -> dict[str, bytes]:
        obj = self._get_data_object(
            w.ns, kind, src.get("name") or src.get("secretName", ""), bool(src.get("optional"))
        )
        if obj is None:
            return {}
        data: dict[str, bytes] = {}
        for k, v in (obj.get("data") or {}).items():
            data[k] = base64.b64decode(v) if kind == "secrets" else v.encode()
        for k, v in (obj.get("binaryData") or {}).items():
            data[k] = base64.b64decode(v)
        if not src.get("items"):
            return data
        out = {}
        for item in src["items"]:
            if item["key"] in data:
                out[item["path"]] = data[item["key"]]
            elif not src.get("optional"):
                raise SetupError(
                    "FailedMount",
                    f"key {item['key']} not found in {kind[:-1]} {w.ns}/{obj['metadata']['name']}",
                )
        return out

    def _downward_files(self, w: _PodWorker, src: Json) -> dict[str, bytes]:
        out = {}
        for item in src.get("items") or []:
            if "fieldRef" in item:
                value = self._field(w, item["fieldRef"]["fieldPath"])
            else:
                value = self._resource_field(w, item["resourceFieldRef"], None)
            out[item["path"]] = value.encode()
        return out

    def _make_volume(self, w: _PodWorker, v: Json, path: Path) -> _Volume:
        security = (w.spec.get("securityContext") or {}) if self.run_as_user else {}
        fs_group = security.get("fsGroup")

        def write(files: dict[str, bytes], mode: int) -> None:
            path.mkdir(parents=True, exist_ok=True)
            for rel, content in files.items():
                f = path / rel
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(content)
                f.chmod(mode)
                if fs_group is not None:  # as a kubelet does: group-owned by fsGroup
                    os.chown(f, -1, int(fs_group))

        if "emptyDir" in v:
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
            ed = v["emptyDir"] or {}
            if ed.get("medium") == "Memory":
                opts = "mode=1777"
                if ed.get("sizeLimit"):
                    opts += f",size={int(parse_quantity(ed['sizeLimit']))}"
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                    check=True,
                    capture_output=True,
                )
                return _Volume(path, tmpfs=True)
            return _Volume(path)
        if "hostPath" in v:
            hp = v["hostPath"]
            host = Path(hp["path"])
            kind = hp.get("type") or ""
            if kind == "DirectoryOrCreate":
                host.mkdir(parents=True, exist_ok=True)
            elif kind == "FileOrCreate":
                host.parent.mkdir(parents=True, exist_ok=True)
                host.touch()
            elif kind == "Directory" and not host.is_dir():
                raise SetupError(
                    "FailedMount", f"hostPath type check failed: {host} is not a directory"
                )
            elif kind == "File" and not host.is_file():
                raise SetupError("FailedMount", f"hostPath type check failed: {host} is not a file")
            elif kind and not host.exists():
                raise SetupError("FailedMount", f"hostPath {host} does not exist")
            return _Volume(host)
        if "configMap" in v or "secret" in v:
            kind, src = (
                ("configmaps", v["configMap"]) if "configMap" in v else ("secrets", v["secret"])
            )
            write(self._data_files(w, kind, src), int(src.get("defaultMode", 0o644)))
            return _Volume(path, read_only=True)
        if "downwardAPI" in v:
            write(
                self._downward_files(w, v["downwardAPI"]),
                int(v["downwardAPI"].get("defaultMode", 0o644)),
            )
            return _Volume(path, read_only=True)
        if "projected" in v:
            proj = v["projected"]
            files: dict[str, bytes] = {}
            for src in proj.get("sources") or []:
                if "serviceAccountToken" in src:
                    files[src["serviceAccountToken"]["path"]] = self._token(
                        w, src["serviceAccountToken"]
                    ).encode()
                elif "configMap" in src:
                    if src["configMap"].get("name") == "kube-root-ca.crt" and not src[
                        "configMap"
                    ].get("optional"):
                        # Published by the controller-manager shortly after a namespace exists.
                        obj = self.api.get_or_none(
                            f"/api/v1/namespaces/{w.ns}/configmaps/kube-root-ca.crt"
                        )
                        if obj is None:
                            files["ca.crt"] = self.api.ca_pem.encode()
                            continue
                    files.update(self._data_files(w, "configmaps", src["configMap"]))
                elif "secret" in src:
                    files.update(self._data_files(w, "secrets", src["secret"]))
                elif "downwardAPI" in src:
                    files.update(self._downward_files(w, src["downwardAPI"]))
                else:
                    raise SetupError("FailedMount", f"unsupported projected source {sorted(src)}")
            write(files, int(proj.get("defaultMode", 0o644)))
            return _Volume(path, read_only=True)
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]
            pvc = self.api.get_or_none(
                f"/api/v1/namespaces/{w.ns}/persistentvolumeclaims/{claim['claimName']}"
            )
            pv_name = (pvc or {}).get("spec", {}).get("volumeName")
            if not pv_name:
                raise SetupError("FailedMount", f"PVC {claim['claimName']} is not bound")
            pv = self.api.get(f"/api/v1/persistentvolumes/{pv_name}")
            local = pv["spec"].get("hostPath") or pv["spec"].get("local")
            if not local:
                raise SetupError(
                    "FailedMount", f"PV {pv_name}: only hostPath and local PVs are supported"
                )
            return _Volume(Path(local["path"]), read_only=bool(claim.get("readOnly")))
        kinds = sorted(set(v) - {"name"})
        raise SetupError(
            "FailedMount", f"volume {v['name']}: type {kinds} not supported by the test kubelet"
        )

    def _run_probe(self, w: _PodWorker, c: _Container, spec: Json) -> tuple[bool, str]:
        timeout = float(spec.get("timeoutSeconds") or 1)
        if "exec" in spec:
            proc = c.proc
            if proc is None or not _launched(proc.pid):
                return False, "container not running yet"
            uid, gid = c.user  # as the container's user, like a runtime's exec
            cmd = [
                "nsenter",
                "-t",
                str(proc.pid),
                "-n",
                "-m",
                "-u",
                *(["-G", str(gid)] if gid is not None else []),
                *(["-S", str(uid)] if uid is not None else []),
                "--",
                *spec["exec"].get("command", []),
            ]
            p = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=c.env,
                cwd="/",
                start_new_session=True,
            )
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
                return False, f"command timed out after {timeout:g}s"
            text = out.decode(errors="replace").strip()[-500:]
            return p.returncode == 0, text or f"exit code {p.returncode}"
        port_spec = (spec.get("httpGet") or spec.get("tcpSocket") or {}).get("port")
        port = self._port(c.spec, port_spec)
        if "httpGet" in spec:
            hg = spec["httpGet"]
            host = hg.get("host") or w.pod_ip
            scheme = (hg.get("scheme") or "HTTP").lower()
            path = hg.get("path") or "/"
            if not path.startswith("/"):
                path = "/" + path
            headers = {h["name"]: h["value"] for h in hg.get("httpHeaders") or []}
            headers.setdefault("User-Agent", "kube-probe/dpserve-test")
            try:
                r = self._probe_http.get(
                    f"{scheme}://{host}:{port}{path}", headers=headers, timeout=timeout
                )
            except httpx.HTTPError as e:
                return False, f"Get {path}: {type(e).__name__}: {e}"
            return 200 <= r.status_code < 400, f"HTTP probe failed with statuscode: {r.status_code}"
        if "tcpSocket" in spec:
            host = spec["tcpSocket"].get("host") or w.pod_ip
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as e:
                return False, f"dial tcp {host}:{port}: {e}"
            return True, ""
        kind = sorted(set(spec) & {"grpc"}) or sorted(spec)
        return False, f"probe type {kind} not supported by the test kubelet"

    @staticmethod
    def _port(container: Json, port: Any) -> int:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        for p in container.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"port {port!r} not found in container {container.get('name')}")


def _launched(pid: int) -> bool:
    """Whether the process is the container's command (past ip netns exec/unshare/podexec)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and argv[0] not in (b"ip", b"unshare") and str(PODEXEC).encode() not in argv


# ---------------------------------------------------------------------- leftovers


def _unmount_under(root: Path) -> None:
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _remove_root(root: Path, made: list[str]) -> None:
    if not str(root) or root == Path():
        return
    _unmount_under(root)
    for path in sorted(made, key=len, reverse=True):
        p = Path(path)
        with contextlib.suppress(OSError):
            if p.is_file() and p.stat().st_size == 0:
                p.unlink()
            else:
                p.rmdir()  # only when empty: never anything else's
    shutil.rmtree(root, ignore_errors=True)


def _cleanup_stale_roots() -> None:
    """Kubelet dirs of dead processes (a crashed run): their tmpfs mounts and mount points."""
    for root in Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*"):
        try:
            pid = int((root / "kubelet.pid").read_text())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{pid}").exists():
            continue
        try:
            made = json.loads((root / "made-dirs.json").read_text())
        except (OSError, ValueError):
            made = []
        _remove_root(root, made)
