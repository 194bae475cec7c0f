"""The test node's pod network, as CNI configuration for containerd's CRI plugin.

Debian's reference plugins: ``bridge`` puts each pod's ``eth0`` on the node's
bridge (which the harness made before the apiserver bound its address), with an
address from ``host-local`` and a default route via the bridge's gateway address;
``portmap`` serves ``hostPort``s; containerd adds ``loopback`` itself.

``teardown`` is CNI's DEL for a sandbox whose runtime is gone (a killed run, or a
stop that bypasses the kubelet): each plugin in reverse order, as a runtime would.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

CNI_BIN = Path("/usr/lib/cni")
NETWORK = "dpserve-node"


def conflist(
    bridge: str,
    subnet: str,
    gateway: str,
    ipam_dir: Path,
    ip_range: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """``ip_range`` (first, last): this node's slice of the shared subnet, so that two
    nodes' host-local allocators (each with its own leases) never hand out one address."""
    span = {"rangeStart": ip_range[0], "rangeEnd": ip_range[1]} if ip_range else {}
    return {
        "cniVersion": "0.4.0",
        "name": NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": True,  # the gateway address is the pods' default route
                "ipMasq": False,  # pods talk to this machine only: no NAT rules to leave behind
                "hairpinMode": True,  # a pod reaches itself through its own Service
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet, "gateway": gateway, **span}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    # Out of /var/lib/cni: leases go with the node's run directory.
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def teardown(config: dict[str, Any], container_id: str, netns: str | None) -> None:
    """CNI DEL of ``container_id`` for every plugin (best effort: errors are ignored,
    as a runtime does when the sandbox is gone)."""
    env = {
        **os.environ,
        "CNI_COMMAND": "DEL",
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": netns or "",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": str(CNI_BIN),
    }
    for plugin in reversed(config["plugins"]):
        conf = {"cniVersion": config["cniVersion"], "name": config["name"], **plugin}
        subprocess.run(
            [str(CNI_BIN / plugin["type"])],
            input=json.dumps(conf),
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
