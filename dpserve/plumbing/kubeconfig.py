"""The Kubernetes client's configuration, for the operator and the router alike."""

from __future__ import annotations

from kubernetes import config


def load_config() -> None:
    """In a pod: its service account; elsewhere: the kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
