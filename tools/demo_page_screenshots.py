"""Screenshots of the demo page for the README: a live server on the demo model,
headless Chromium, a sample picked and asked twice (the second answer shows the
caches' hits), then the whole page at desktop and at phone width.

    .venv/bin/python tools/demo_page_screenshots.py [--out docs]

Needs Debian's chromium and chromium-driver (``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import argparse
import base64
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from api.launch import launch_server

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = {"desktop": (1280, 900), "phone": (390, 844)}


def _browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def _ask(driver: webdriver.Chrome, chip_text: str | None = None) -> None:
    if chip_text is not None:
        chips = driver.find_elements(By.CSS_SELECTOR, "#suggestions .chip")
        next(c for c in chips if c.text.startswith(chip_text)).click()
    driver.find_element(By.ID, "ask").click()
    WebDriverWait(driver, 120, 0.1).until(lambda d: d.find_element(By.ID, "status").text.startswith(("Done", "Failed")))


def _full_page(driver: webdriver.Chrome, path: Path, width: int) -> None:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "demo")
    args = parser.parse_args()
    with launch_server(args.model) as server:
        driver = _browser()
        try:
            for name, (width, height) in WIDTHS.items():
                driver.set_window_size(width, height)
                driver.get(server.url + "/")
                WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".sample"))
                driver.find_element(By.CSS_SELECTOR, '.sample[data-name="moving-shape"]').click()
                WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#suggestions .chip"))
                _ask(driver)
                _ask(driver, "Describe the video.")
                time.sleep(3.5)  # the panel's next refresh
                _full_page(driver, args.out / f"demo_page_{name}.png", width)
                print(args.out / f"demo_page_{name}.png")
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
