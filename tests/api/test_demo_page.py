"""The video-QA demo page (api/static/index.html) driven by headless Chromium.

A live `swallow serve` with a random multimodal checkpoint; the page uploads a
generated video, streams the chat answer into #answer, and shows server errors
in #error. Chromium and chromedriver come from Debian (installed here if missing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from tests.api.live import live_server

pytestmark = pytest.mark.slow

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: pip install -e '.[dev]'")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMEDRIVER = "/usr/bin/chromedriver"
ANSWER_TIMEOUT_S = 60


def _chromium_binaries() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = CHROMEDRIVER if os.access(CHROMEDRIVER, os.X_OK) else shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """(browser, chromedriver) paths; apt-installs Debian's chromium + chromium-driver if absent."""
    found = _chromium_binaries()
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("chromium/chromedriver not on PATH and no apt-get to install them")
    if os.geteuid() != 0:
        pytest.skip("chromium/chromedriver not on PATH; install them with: "
                    "sudo apt-get install -y chromium chromium-driver")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]
    log = ""
    for steps in ([install], [["apt-get", "update"], install]):  # retry with fresh package lists
        try:
            for argv in steps:
                result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
                log = result.stderr[-2000:]
                if result.returncode != 0:
                    break
        except (OSError, subprocess.TimeoutExpired) as exc:
            log = str(exc)
        if found := _chromium_binaries():
            return found
    pytest.skip(f"could not install chromium + chromium-driver with apt-get (offline?):\n{log}")


@pytest.fixture(scope="module")
def browser(chromium: tuple[str, str]) -> Iterator[webdriver.Chrome]:
    binary, driver_path = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary  # with an explicit driver too, Selenium Manager never downloads anything
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from api.cli import main

    out = tmp_path_factory.mktemp("demo") / "model"
    assert main(["init-checkpoint", str(out), "--multimodal", "--seed", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def server(multimodal_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("swallow-home")
    env = {**os.environ, "SWALLOW_HOME": str(home)}
    env.pop("SWALLOW_API_KEY", None)
    with live_server(multimodal_checkpoint, "--spool-dir", str(home / "spool"), env=env) as live:
        yield live.url


def write_clip(path: Path, seconds: float = 2.0, fps: int = 10, size: int = 64) -> Path:
    """A small moving-gradient MP4 (H.264 if this PyAV build has it, else MPEG-4 part 2)."""
    import av

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        ramp = np.arange(size, dtype=np.uint8)[None, :] * 4
        for i in range(int(seconds * fps)):
            frame = np.zeros((size, size, 3), np.uint8)
            frame[..., 0] = ramp + i * 8
            frame[size // 4 : size // 2, (i * 3) % (size - 8) :][:, :8, 2] = 220
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _text(driver: webdriver.Chrome, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def _ask(driver: webdriver.Chrome, url: str, media: Path, question: str) -> None:
    driver.get(url + "/")
    WebDriverWait(driver, 10).until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))
    driver.find_element(By.ID, "file").send_keys(str(media))
    driver.find_element(By.ID, "question").send_keys(question)
    driver.find_element(By.ID, "ask").click()


def _wait(driver: webdriver.Chrome, condition, what: str) -> None:
    try:
        WebDriverWait(driver, ANSWER_TIMEOUT_S, poll_frequency=0.1).until(condition)
    except TimeoutException:
        pytest.fail(f"timed out waiting for {what}; status={_text(driver, 'status')!r} "
                    f"error={_text(driver, 'error')!r} answer={_text(driver, 'answer')!r}")


def test_video_question_streams_an_answer(browser: webdriver.Chrome, server: str, tmp_path: Path) -> None:
    clip = write_clip(tmp_path / "clip.mp4")
    _ask(browser, server, clip, "What moves in this video?")
    assert browser.find_elements(By.CSS_SELECTOR, "#preview video"), "no <video> preview of the chosen file"

    _wait(browser, lambda d: _text(d, "answer").strip(), "the first streamed text in #answer")
    _wait(browser, lambda d: _text(d, "status").startswith(("Done", "Failed")), "the end of the stream")

    assert not browser.find_element(By.ID, "error").is_displayed(), _text(browser, "error")
    answer = browser.find_element(By.ID, "answer")
    assert answer.text.strip()
    assert int(answer.get_attribute("data-chunks")) > 1, "the answer arrived in a single chunk, not streamed"
    usage = _text(browser, "usage")
    assert "completion tokens" in usage and "tokens/s" in usage, usage
    assert browser.find_element(By.ID, "ask").is_enabled()


def test_non_media_upload_shows_the_415_message(browser: webdriver.Chrome, server: str, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("just some plain text, not a video\n" * 20)
    _ask(browser, server, notes, "What is this?")

    _wait(browser, lambda d: d.find_element(By.ID, "error").is_displayed(), "#error to appear")
    error = _text(browser, "error")
    assert "unsupported media type" in error and "notes.txt" in error and "415" in error, error
    assert _text(browser, "answer") == ""
    assert browser.find_element(By.ID, "ask").is_enabled()
