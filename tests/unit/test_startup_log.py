"""A rank's start-up phases in the log, and the one transformers warning dropped."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from dpserve.worker.quiet import WORDS, quiet_torchvision_fallback
from dpserve.worker.startup import StartupLog, folder_size, human_bytes


def test_phases_add_up_and_only_the_driver_speaks(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.startup")
    driver, other = StartupLog(log, speaks=True), StartupLog(log, speaks=False)
    with caplog.at_level(logging.INFO, "test.startup"):
        for startup in (driver, other):
            startup.say("loading %s", "m")
            with startup.phase("load"):
                pass
            with startup.phase("warm-up"):
                pass
    assert [r.getMessage() for r in caplog.records] == ["loading m"]
    assert list(driver.took) == ["load", "warm-up"]
    summary = driver.summary()
    assert summary.startswith("start-up ") and summary.endswith("load 0.0s, warm-up 0.0s")


def test_a_phase_that_fails_is_still_timed() -> None:
    startup = StartupLog(logging.getLogger("test.startup"), speaks=False)
    with pytest.raises(RuntimeError), startup.phase("load"):
        raise RuntimeError("bad weights")
    assert "load" in startup.took


def test_sizes_read_as_a_person_reads_them(tmp_path: Path) -> None:
    assert [human_bytes(n) for n in (0, 999, 4_800_000, 40 * 10**9, 3 * 10**12)] == [
        "0 B",
        "999 B",
        "4.8 MB",
        "40.0 GB",
        "3.0 TB",
    ]
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "w.safetensors").write_bytes(b"x" * 1500)
    (tmp_path / "gone").symlink_to(tmp_path / "nothing")  # dangling: skipped, not fatal
    assert folder_size(tmp_path) == "1.5 KB"


def test_the_filter_drops_only_the_fallback_warning(caplog: pytest.LogCaptureFixture) -> None:
    quiet_torchvision_fallback()
    quiet_torchvision_fallback()  # once is enough; twice adds nothing
    logger = logging.getLogger("transformers.utils.import_utils")
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger.name):
        logger.warning("`CLIPImageProcessor` %s `CLIPImageProcessorPil`", WORDS)
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


@pytest.mark.skipif(find_spec("torchvision") is not None, reason="no fallback to warn about")
def test_transformers_says_it_without_the_filter_and_not_with_it() -> None:
    """Against the real transformers, in one fresh process: the words it logs for one
    processor before the filter are the words the filter drops for another after it."""
    code = (
        "from transformers import CLIPImageProcessor\n"
        "import sys; print('--- filter', file=sys.stderr, flush=True)\n"
        "from dpserve.worker.quiet import quiet_torchvision_fallback\n"
        "quiet_torchvision_fallback()\n"
        "from transformers import SiglipImageProcessor\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, after = done.stderr.split("--- filter")
    assert WORDS in before and "CLIPImageProcessor" in before
    assert "torchvision" not in after
