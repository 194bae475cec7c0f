"""A token check in front of olah, which checks none: Debian's nginx passes a request on
only with ``Authorization: Bearer <token>``, so a test can serve a private repository and
see that the client sends its token. Nothing of the hub's API is answered here."""

from __future__ import annotations

import re
from pathlib import Path

# Written into nginx's configuration as is, so only characters that need no quoting.
TOKEN = re.compile(r"[A-Za-z0-9_-]{8,128}")


def check_token(token: str) -> str:
    if not TOKEN.fullmatch(token):
        raise ValueError(f"a test hub's token is 8-128 of [A-Za-z0-9_-], got {token!r}")
    return token


def write_config(prefix: Path, host: str, port: int, upstream_port: int, token: str) -> Path:
    """nginx's configuration in ``prefix`` (its logs and temporary files stay there too):
    listen on ``host:port``, pass authorised requests to olah on loopback, unbuffered."""
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    temp = "".join(
        f"  {kind}_temp_path tmp/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    path = prefix / "nginx.conf"
    path.write_text(
        "pid nginx.pid;\n"
        "events { worker_connections 256; }\n"
        "http {\n"
        "  access_log access.log;\n"
        f"{temp}"
        "  map $http_authorization $granted {\n"
        "    default 0;\n"
        f'    "Bearer {check_token(token)}" 1;\n'
        "  }\n"
        "  server {\n"
        f"    listen {host}:{port};\n"
        "    location / {\n"
        # The hub's answer to a private repository asked for without its token (the same
        # headers olah gives a repository it does not have); the client raises
        # RepositoryNotFoundError on it, as it would against the hub.
        "      if ($granted = 0) {\n"
        "        add_header X-Error-Code RepoNotFound always;\n"
        '        add_header X-Error-Message "Repository not found" always;\n'
        "        return 401;\n"
        "      }\n"
        f"      proxy_pass http://127.0.0.1:{upstream_port};\n"
        "      proxy_http_version 1.1;\n"
        "      proxy_buffering off;\n"
        "      proxy_request_buffering off;\n"
        "      proxy_set_header Host $http_host;\n"
        "    }\n"
        "  }\n"
        "}\n"
    )
    return path
