"""The browser tier's fixtures: a real headless Chromium driven through WebDriver (Debian's
`chromium` and `chromium-driver`, the official `selenium` client), and one `bubbletea up` per test
file with prompts sent to it the whole time.

Chromium and chromedriver are found on PATH. Where either is missing, the tier installs both with
apt (`apt-get install -y --no-install-recommends chromium chromium-driver`) when it runs as root with
apt-get there, once: a lock file in the system's temporary directory makes pytest-xdist's other
workers wait and then find them installed. Otherwise every test of the tier skips, saying why."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.browser.live import Load, Up, start_up

if TYPE_CHECKING:
    from selenium.webdriver import Chrome as WebDriver

APT_INSTALL = ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]
#: Held while one pytest worker installs Chromium; the others wait on it, then find it there.
INSTALL_LOCK = Path(tempfile.gettempdir()) / "bubbletea-tests-chromium.lock"
#: apt's first install of Chromium downloads about 100 MB: generous, and only a failure waits it out.
INSTALL_TIMEOUT_S = 600


def _binaries() -> tuple[str, str] | None:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


def _install() -> str | None:
    """Install Chromium and its driver with apt; None once done, else why it could not be."""
    if os.geteuid() != 0:
        return "not root, so the tier cannot install them"
    if shutil.which("apt-get") is None:
        return "no apt-get to install them with"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        res = subprocess.run(APT_INSTALL, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(APT_INSTALL)}` did not finish within {INSTALL_TIMEOUT_S} s"
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1:] or ["no output"]
        return f"`{' '.join(APT_INSTALL)}` failed ({res.returncode}): {last[0]}"
    return None


@pytest.fixture(scope="session")
def chromium_binaries() -> tuple[str, str]:
    """(chromium, chromedriver): found, or installed once; the test skips saying why otherwise."""
    pytest.importorskip("selenium", reason="selenium is not installed (make install puts it in .venv)")
    if (found := _binaries()) is not None:
        return found
    with INSTALL_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if (found := _binaries()) is not None:  # another worker installed them while this one waited
            return found
        why = _install()
    if why is None and (found := _binaries()) is not None:
        return found
    pytest.skip(f"chromium or chromedriver not on PATH: {why or 'apt installed them elsewhere'}")


@pytest.fixture(scope="module")
def browser(chromium_binaries: tuple[str, str]) -> Iterator[WebDriver]:
    """A headless Chromium whose console messages `driver.get_log("browser")` returns."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = chromium_binaries
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # --no-sandbox: Chromium refuses to start its sandbox as root (the tier may run as root, in CI);
    # /dev/shm is small in containers, where Chromium's renderer then crashes.
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver given: Selenium Manager (which would download one) is not asked
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def up(chromium_binaries: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`bubbletea up` (PP=2 x DP=1, the e2e tests' spec), serving, stopped with SIGTERM at the end.
    Started only where a browser can look at it (`chromium_binaries` skips the test otherwise)."""
    with start_up(tmp_path_factory.mktemp("up")) as running:
        yield running


@pytest.fixture(scope="module")
def load(up: Up) -> Iterator[Load]:
    """Prompts sent to `up`'s front door a few a second, from /ready until the file's tests end."""
    with Load(up.api) as sending:
        yield sending
