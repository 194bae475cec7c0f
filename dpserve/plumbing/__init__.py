"""Plumbing both sides use: ZMQ sockets (``transport``), CURVE authentication of the wire
(``curve``), ports (``ports``, ``bind``), child processes (``proc``), size-bounded reads of
untrusted bytes (``untrusted``) and the Kubernetes client's configuration (``kubeconfig``)."""
