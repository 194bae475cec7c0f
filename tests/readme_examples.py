"""The README's Python examples, and the docs' shell examples, run as written against a
test's server."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_readme_example(port: int, holding: str) -> dict[str, Any]:
    """Run the README's one Python example that holds ``holding`` against ``port``; its names."""
    readme = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    (code,) = [b for b in blocks if holding in b]
    scope: dict[str, Any] = {}
    exec(code.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), scope)
    return scope


def run_shell_example(
    doc: str, port: int, holding: str, cwd: Path, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run the one ``sh`` block of ``doc`` (a path from the repository root) that holds
    ``holding``, with bash, in ``cwd``, against ``port``; stopped at its first failure."""
    text = (ROOT / doc).read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```sh\n")[1:]]
    (script,) = [b for b in blocks if holding in b]
    script = script.replace("localhost:8000", f"127.0.0.1:{port}")
    return subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )
