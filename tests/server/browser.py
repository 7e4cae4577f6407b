"""A headless Chromium driven by Selenium, for the tests of the live page: Debian's (or any
distribution's) ``chromium`` and ``chromedriver`` on PATH; the test is skipped, saying why, only
when no Chromium binary is installed (``.ci/run`` installs it as root)."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DRIVERS = ("chromedriver", "/usr/lib/chromium/chromedriver")


def chromium_binary() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


@contextlib.contextmanager
def headless_chromium(width: int = 1400, height: int = 1700) -> Iterator[Any]:
    binary = chromium_binary()
    if binary is None:
        pytest.skip(f"no Chromium binary on PATH (looked for {', '.join(BROWSERS)}): "
                    "apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    driver_path = next((p for p in map(shutil.which, DRIVERS) if p), None)
    service = Service(executable_path=driver_path) if driver_path else Service()
    driver = webdriver.Chrome(options=opts, service=service)
    try:
        yield driver
    finally:
        driver.quit()  # stops chromedriver and the browser it started


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def text(driver: Any, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById({element_id!r}).textContent").strip()


def table(driver: Any, element_id: str) -> list[list[str]]:
    return driver.execute_script(
        f"return Array.from(document.getElementById({element_id!r}).tBodies[0].rows)"
        ".map(r => Array.from(r.cells).map(c => c.textContent.trim()))")


def screenshot(driver: Any, path: os.PathLike | str) -> str:
    path = os.fspath(path)
    driver.save_screenshot(path)
    print(f"dashboard screenshot: {path}")
    return path
