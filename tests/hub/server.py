"""A real hub-API server for tests of ``hf://`` sources: olah (installed by
tests/hub/setup.sh) serving git repositories made here (tests/hub/repo.py), with no
upstream, so the real ``huggingface_hub`` download code runs against ``HF_ENDPOINT``.
With a token, nginx asks for it in front (tests/hub/gate.py). What this proves and what
it does not: docs/testing.md, "The hub server".

``huggingface_hub`` reads ``HF_ENDPOINT`` once, when it is imported: code in this
process passes ``endpoint=hub.endpoint``; a child process gets ``hub.env(home)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from dpserve.plumbing.ports import free_port
from tests.hub import gate
from tests.hub.repo import PublishedRepo, RepoSpec, publish
from tests.polling import eventually

__all__ = ["TINY_REPO", "Hub", "PublishedRepo", "RepoSpec", "serve_hub"]

SETUP = Path(__file__).with_name("setup.sh")
TINY_REPO = "dpserve/tiny"
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Hub:
    endpoint: str  # the value for HF_ENDPOINT
    repos: Mapping[str, PublishedRepo]
    token: str | None = None  # every request needs it, where set

    @property
    def repo(self) -> PublishedRepo:
        """The one repository, where the hub serves one."""
        (only,) = self.repos.values()
        return only

    def env(self, home: Path) -> dict[str, str]:
        """A child process's environment: this hub, its token if it has one, and ``home``
        as HF_HOME (the cache), so no test reads or fills the machine's own. Online,
        whatever this process inherited: a worker gang started here sets HF_HUB_OFFLINE=1
        (and the images do)."""
        env = {**os.environ, "HF_ENDPOINT": self.endpoint, "HF_HOME": str(home)}
        env["HF_HUB_OFFLINE"] = "0"
        env.pop("HF_TOKEN", None)
        if self.token is not None:
            env["HF_TOKEN"] = self.token
        return env


@dataclass(frozen=True)
class Tools:
    olah: Path
    nginx: Path


def tools() -> Tools:
    """olah's command and nginx, installed by tests/hub/setup.sh on first use (under a
    minute, once)."""
    done = subprocess.run(
        ["bash", str(SETUP)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{SETUP} failed ({done.returncode}): {done.stderr.strip()}")
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return Tools(Path(found["olah"]), Path(found["nginx"]))


@contextmanager
def serve_hub(
    workdir: Path, specs: Sequence[RepoSpec], host: str = "127.0.0.1", token: str | None = None
) -> Iterator[Hub]:
    """olah serving ``specs`` from ``workdir`` on a free port of ``host`` (pods in their own
    network namespaces reach a bridge address, not loopback); with ``token``, behind
    nginx, which passes on only requests that carry it. Yields once every repository
    answers its ``main`` commit; stops both on exit."""
    if token is not None:
        gate.check_token(token)
    found = tools()
    workdir.mkdir(parents=True, exist_ok=True)
    mirrors = workdir / "mirrors"
    repos = {spec.repo_id: publish(spec, mirrors) for spec in specs}
    with ExitStack() as stack:
        olah_host = host if token is None else "127.0.0.1"
        olah_port = free_port(olah_host)
        config = _olah_config(workdir, olah_host, olah_port, mirrors)
        cmd = [str(found.olah), "--config", str(config), "--log-path", str(workdir / "logs")]
        running = [stack.enter_context(_running(cmd, workdir, workdir / "olah.log"))]
        port = olah_port
        if token is not None:
            port = free_port(host)
            prefix = workdir / "nginx"
            conf = gate.write_config(prefix, host, port, olah_port, token)
            cmd = [str(found.nginx), "-p", str(prefix), "-c", str(conf), "-e", "error.log"]
            cmd += ["-g", "daemon off; master_process off;"]
            running.append(stack.enter_context(_running(cmd, prefix, prefix / "nginx.log")))
        hub = Hub(f"http://{host}:{port}", repos, token)
        _wait_serving(hub, running)
        yield hub


def _olah_config(workdir: Path, host: str, port: int, mirrors: Path) -> Path:
    """olah's settings: serve the local mirrors and never ask huggingface.co (offline)."""
    path = workdir / "olah.toml"
    path.write_text(
        "[basic]\n"
        f'host = "{host}"\n'
        f"port = {port}\n"
        f'repos-path = "{workdir / "cache"}"\n'
        f'mirrors-path = ["{mirrors}"]\n'
        "[accessibility]\n"
        "offline = true\n"
    )
    return path


@dataclass(frozen=True)
class _Running:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@contextmanager
def _running(cmd: list[str], cwd: Path, log: Path) -> Iterator[_Running]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield _Running(Path(cmd[0]).name, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_serving(hub: Hub, running: Sequence[_Running]) -> None:
    headers = {} if hub.token is None else {"Authorization": f"Bearer {hub.token}"}

    def serving_or_dead() -> bool:
        if any(r.proc.poll() is not None for r in running):
            return True
        for repo in hub.repos.values():
            url = f"{hub.endpoint}/api/models/{repo.repo_id}/revision/main"
            if httpx.get(url, headers=headers, timeout=5).json().get("sha") != repo.main:
                return False
        return True

    eventually(serving_or_dead, START_TIMEOUT_S, "the hub to serve the test repositories", 0.1)
    for r in running:
        if r.proc.poll() is not None:
            tail = r.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{r.name} exited with {r.proc.returncode}:\n{tail}")
