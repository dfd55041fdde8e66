"""The demo page (demo/static/index.html) driven by headless Chromium against a
live `swallow serve` of the committed demo model: a sample picked from the
gallery and asked about streams the right answer with its timing line; a second
question about it shows the caches' hits; a large upload moves the progress
bar; the SWA panel shows the numbers /metrics shows; the page works at phone
width and from the keyboard. Chromium and chromedriver come from Debian
(installed here if missing).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from tests.api.live import live_server

pytestmark = pytest.mark.slow

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: pip install -e '.[dev]'")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMEDRIVER = "/usr/bin/chromedriver"
ANSWER_TIMEOUT_S = 60
DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


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
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("swallow-home")
    env = {**os.environ, "SWALLOW_HOME": str(home)}
    env.pop("SWALLOW_API_KEY", None)
    with live_server(DEMO, "--spool-dir", str(home / "spool"), env=env) as live:
        yield live.url


def write_clip(path: Path, seconds: float = 2.0, fps: int = 10, size: int = 64, noise: bool = False) -> Path:
    """A moving-gradient MP4 (H.264 if this PyAV build has it, else MPEG-4 part 2);
    with ``noise``, frames of random pixels at the codec's best quality, which no
    encoder can shrink: a large file of a known size."""
    import av

    codec = "mpeg4" if noise or "libx264" not in av.codecs_available else "libx264"
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        if noise:
            stream.options = {"qscale": "1", "qmin": "1", "qmax": "1"}
        ramp = np.arange(size, dtype=np.uint8)[None, :] * 4
        for i in range(int(seconds * fps)):
            if noise:
                frame = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            else:
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


def _data(driver: webdriver.Chrome, element_id: str, name: str) -> str | None:
    return driver.find_element(By.ID, element_id).get_attribute(f"data-{name}")


def _open(driver: webdriver.Chrome, url: str) -> None:
    driver.get(url + "/")
    WebDriverWait(driver, 10).until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))


def _ask(driver: webdriver.Chrome, url: str, media: Path, question: str) -> None:
    _open(driver, url)
    driver.find_element(By.ID, "file").send_keys(str(media))
    driver.find_element(By.ID, "question").send_keys(question)
    driver.find_element(By.ID, "ask").click()


def _wait(driver: webdriver.Chrome, condition, what: str, timeout: float = ANSWER_TIMEOUT_S) -> None:
    try:
        WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)
    except TimeoutException:
        pytest.fail(f"timed out waiting for {what}; status={_text(driver, 'status')!r} "
                    f"error={_text(driver, 'error')!r} answer={_text(driver, 'answer')!r}")


def _wait_done(driver: webdriver.Chrome) -> None:
    _wait(driver, lambda d: _text(d, "status").startswith(("Done", "Failed")), "the end of the stream")
    assert not driver.find_element(By.ID, "error").is_displayed(), _text(driver, "error")


def _normal(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


def _pick_sample(driver: webdriver.Chrome, name: str) -> None:
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, f'.sample[data-name="{name}"]'), "the gallery", 30)
    driver.find_element(By.CSS_SELECTOR, f'.sample[data-name="{name}"]').click()
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#suggestions .chip"), "the sample's questions", 30)


def _gallery(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(url + "/demo/samples", timeout=60) as response:
        return {s["name"]: s for s in json.load(response)["samples"]}


def test_a_sample_answers_right_and_a_second_question_hits_the_caches(browser: webdriver.Chrome, server: str) -> None:
    sample = _gallery(server)["moving-shape"]
    first, describe = sample["questions"][0], sample["questions"][1]
    _open(browser, server)
    _pick_sample(browser, "moving-shape")
    assert browser.find_elements(By.CSS_SELECTOR, "#preview video"), "no <video> preview of the sample"
    assert browser.find_element(By.ID, "question").get_attribute("value") == first["text"]
    browser.find_element(By.ID, "ask").click()
    _wait(browser, lambda d: _text(d, "answer").strip(), "the first streamed text in #answer")
    _wait_done(browser)
    assert _normal(_text(browser, "answer")) == _normal(first["answer"])
    timing = _text(browser, "usage")
    assert "first token after" in timing and "tokens/s" in timing and "prompt tokens" in timing, timing
    assert float(_data(browser, "usage", "ttft")) > 0 and int(_data(browser, "usage", "prompt-tokens")) > 0

    # The second question about the same clip: its picture's embedding and the
    # prompt up to the question come from the caches.
    chips = browser.find_elements(By.CSS_SELECTOR, "#suggestions .chip")
    next(c for c in chips if c.text.startswith(describe["text"])).click()
    browser.find_element(By.ID, "ask").click()
    _wait(browser, lambda d: int(d.find_element(By.ID, "answer").get_attribute("data-chunks")) > 1,
          "the description to stream in several chunks")
    _wait_done(browser)
    assert _normal(_text(browser, "answer")) == _normal(describe["answer"])
    assert int(_data(browser, "usage", "cached-tokens")) > 0, _text(browser, "usage")
    assert _data(browser, "usage", "media-cached") == "1", _text(browser, "usage")
    assert "from the prefix cache" in _text(browser, "usage") and "from the embedding cache" in _text(browser, "usage")
    # Everything the page loaded came from the server itself: no CDN, no build step.
    origins = browser.execute_script(
        "return performance.getEntriesByType('resource').map((e) => new URL(e.name).origin)")
    assert origins and set(origins) == {server}, origins


def test_a_tool_question_calls_the_tool_and_answers_from_its_result(browser: webdriver.Chrome, server: str) -> None:
    question = next(q for q in _gallery(server)["blinking-light"]["questions"] if q["tools"])
    _open(browser, server)
    _pick_sample(browser, "blinking-light")
    chips = browser.find_elements(By.CSS_SELECTOR, "#suggestions .chip")
    next(c for c in chips if c.text.startswith(question["text"])).click()
    assert browser.find_element(By.ID, "tools").is_selected(), "a tool question offers the tool"
    browser.find_element(By.ID, "ask").click()
    _wait_done(browser)
    (call,) = browser.find_elements(By.CSS_SELECTOR, "#tool-calls .tool-call")
    assert call.find_element(By.CLASS_NAME, "name").text == "get_video_info"
    assert json.loads(call.find_element(By.TAG_NAME, "pre").text) == json.loads(question["call"])["arguments"]
    assert call.find_element(By.CLASS_NAME, "result").text.startswith("→ {")
    # The reply reads the result back in the trained sentence (its digits right
    # most of the time: `swallow eval-demo` scores that).
    assert re.fullmatch(r"The video (has [\d.]+ frames per second|lasts [\d.]+ seconds)\.", _text(browser, "answer"))


def test_a_large_upload_moves_the_progress_bar_before_the_answer(browser: webdriver.Chrome, server: str,
                                                                  tmp_path: Path) -> None:
    clip = write_clip(tmp_path / "large.mp4", seconds=12, fps=10, size=320, noise=True)
    assert clip.stat().st_size > 20 * 10**6, clip.stat().st_size
    # A link of ~80 Mbit/s: the upload takes a couple of seconds, as it would for a user.
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.emulateNetworkConditions", {
        "offline": False, "latency": 5, "downloadThroughput": -1, "uploadThroughput": 10 * 2**20})
    try:
        _ask(browser, server, clip, "Which way does the shape move?")
        _wait(browser, lambda d: _data(d, "progress", "partial") == "true", "the progress bar to move", 30)
        assert browser.find_element(By.ID, "progress").is_displayed()
        assert not _text(browser, "answer"), "the answer came before the upload finished"
        assert re.fullmatch(r"\d+%", _text(browser, "progress-text")), _text(browser, "progress-text")
        _wait_done(browser)
    finally:
        browser.execute_cdp_cmd("Network.emulateNetworkConditions", {
            "offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    assert int(_data(browser, "progress", "events")) > 1
    assert _text(browser, "answer").strip()
    assert not browser.find_element(By.ID, "progress").is_displayed()


def _prometheus(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_swa_panel_shows_what_metrics_shows(browser: webdriver.Chrome, server: str) -> None:
    _open(browser, server)
    _pick_sample(browser, "beeping-clip")  # a video with a sound track: both encoders run
    browser.find_element(By.ID, "ask").click()
    _wait_done(browser)
    # The server is idle now: the panel's next refresh and /metrics read the same values.
    before = browser.find_element(By.TAG_NAME, "aside").get_attribute("data-updated")
    _wait(browser, lambda d: d.find_element(By.TAG_NAME, "aside").get_attribute("data-updated") != before,
          "the panel's next refresh", 10)
    metrics = _prometheus(server)

    def gauge(name: str, **labels: str) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    def shown(element_id: str) -> float:
        return float(_data(browser, element_id, "value"))

    in_use = gauge("swallow_kv_pool_used_bytes", pool="full") + gauge("swallow_kv_pool_used_bytes", pool="swa")
    assert shown("kv-in-use") == in_use > 0
    assert shown("kv-full") == gauge("swallow_kv_full_attention_equivalent_bytes") > in_use
    assert shown("saving") == pytest.approx(gauge("swallow_kv_full_attention_equivalent_bytes") / in_use, abs=1e-3)
    assert shown("full-tokens") == gauge("swallow_kv_pool_used_tokens", pool="full") > 0
    assert shown("swa-slots") == gauge("swallow_kv_pool_used_tokens", pool="swa") > 0
    assert shown("hit-rate") == gauge("swallow_prefix_cache_hit_rate")
    assert shown("cached-tokens") == gauge("swallow_prefix_cache_cached_tokens")
    hits = sum(v for (name, labels), v in metrics.items()
               if name == "swallow_embedding_cache_requests_total" and ("result", "hit") in labels)
    assert shown("embedding-hits") == hits
    for encoder in ("vision", "audio"):
        batches = gauge("swallow_encoder_batch_size_count", encoder=encoder)
        assert batches > 0
        assert shown(f"{encoder}-batch") == pytest.approx(
            gauge("swallow_encoder_batch_size_sum", encoder=encoder) / batches, abs=1e-3)
    assert "×" in _text(browser, "saving")
    # Capacity: the pools' memory given to full attention would hold fewer tokens.
    every_layer = sum(gauge("swallow_kv_pool_bytes_per_token", pool=p) for p in ("full", "swa"))
    memory = sum(gauge("swallow_kv_pool_capacity_tokens", pool=p) * gauge("swallow_kv_pool_bytes_per_token", pool=p)
                 for p in ("full", "swa"))
    assert shown("capacity") == gauge("swallow_kv_pool_capacity_tokens", pool="full")
    assert shown("capacity-full") == memory // every_layer
    assert shown("capacity-gain") == pytest.approx(shown("capacity") / shown("capacity-full"), abs=1e-3)
    assert shown("capacity-gain") > 2


def test_phone_width_and_keyboard(browser: webdriver.Chrome, server: str) -> None:
    browser.set_window_size(390, 844)
    try:
        _open(browser, server)
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".sample"), "the gallery", 30)
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
        main = browser.find_element(By.TAG_NAME, "main").rect
        panel = browser.find_element(By.TAG_NAME, "aside").rect
        assert panel["y"] >= main["y"] + main["height"] - 1, "the panel should stack below the form on a phone"
        # From the keyboard alone: tab to a sample, Enter loads it, Ctrl+Enter asks.
        body = browser.find_element(By.TAG_NAME, "body")
        for _ in range(40):
            body.send_keys(Keys.TAB)
            focused = browser.switch_to.active_element
            if "sample" in (focused.get_attribute("class") or ""):
                break
        else:
            pytest.fail("no sample button is reachable with Tab")
        name = focused.get_attribute("data-name")
        focused.send_keys(Keys.ENTER)
        _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, f'.sample[data-name="{name}"]')
              .get_attribute("aria-pressed") == "true", "the sample to load", 30)
        expected = _gallery(server)[name]["questions"][0]["answer"]
        question = browser.find_element(By.ID, "question")
        question.send_keys(Keys.CONTROL, Keys.ENTER)
        _wait_done(browser)
        assert _normal(_text(browser, "answer")) == _normal(expected)
    finally:
        browser.set_window_size(1000, 900)


def test_video_question_streams_an_answer(browser: webdriver.Chrome, server: str, tmp_path: Path) -> None:
    clip = write_clip(tmp_path / "clip.mp4")
    _ask(browser, server, clip, "Describe the video.")
    assert browser.find_elements(By.CSS_SELECTOR, "#preview video"), "no <video> preview of the chosen file"

    _wait(browser, lambda d: _text(d, "answer").strip(), "the first streamed text in #answer")
    _wait_done(browser)
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
