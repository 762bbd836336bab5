"""Headless Chromium for the dashboard tests: Debian's ``chromium`` and ``chromium-driver``,
driven through Selenium.

:func:`find` says what is missing. A test that needs the browser skips when one is missing,
unless ``KVLOOKUP_REQUIRE_BROWSER=1`` (``.ci/run`` sets it, and installs both packages): then
it fails, so CI can never pass by skipping. The browser runs with a fresh profile and every
feature that would reach the network turned off.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import pytest

REQUIRE_ENV = "KVLOOKUP_REQUIRE_BROWSER"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")


@dataclass(frozen=True)
class Browser:
    chromium: str
    driver: str


def _which(env: str, *names: str) -> str | None:
    for name in (os.environ.get(env), *names):
        found = name and (shutil.which(name) or (os.path.exists(name) and name))
        if found:
            return found
    return None


def find() -> tuple[Browser | None, str]:
    """(the browser, "") or (None, what is missing)."""
    missing = []
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (pip install -e '.[test]')")
    chromium = _which("KVLOOKUP_CHROMIUM", "chromium", "chromium-browser", "google-chrome")
    driver = _which("KVLOOKUP_CHROMEDRIVER", "chromedriver", "/usr/lib/chromium/chromedriver")
    if not chromium:
        missing.append("chromium (apt-get install chromium)")
    if not driver:
        missing.append("chromedriver (apt-get install chromium-driver)")
    if missing:
        return None, "needs " + ", ".join(missing)
    return Browser(chromium, driver), ""


def require() -> Browser:
    """The browser, or skip (fail under ``KVLOOKUP_REQUIRE_BROWSER=1``) naming what is missing."""
    browser, why = find()
    if browser is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{why}; {REQUIRE_ENV}=1 says this run must have a browser")
        pytest.skip(why)
    return browser


def start(browser: Browser, width: int = 1366, height: int = 900):
    """A Selenium Chrome driver on headless Chromium with a throwaway profile; call ``quit()``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser.chromium
    for flag in (*FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='kvlookup-chromium-')}",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(browser.driver), options=options)
