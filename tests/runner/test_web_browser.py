"""``lockstep web`` in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by
Selenium through /usr/bin/chromedriver; no browser download), while a ``lockstep run`` process works.

Chromium missing: the test fails in CI (``CI`` set: .ci/run installs it) and is skipped elsewhere, with the
reason. Set LOCKSTEP_WEB_SCREENSHOT=docs/web.png to also write the screenshot there (docs/web.md's picture).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from history_fixtures import setup_workload
from runner_procs import wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

TICK = """
create table public.ticks (id bigserial primary key);
create function public.tick() returns void language sql as $$ insert into public.ticks default values $$;
select lockstep.define_job('tick', 'public.tick()', every => '1 second');
"""


def _missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            return f"{path} not found (apt-get install chromium chromium-driver; .ci/run does)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


@pytest.fixture
def browser(tmp_path: Path) -> Iterator:
    reason = _missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {reason}")
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1000"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(
        service=Service(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log")), options=opts
    )
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def web_server(tmp_path: Path) -> Iterator:
    """``web_server(dsn, *args) -> url``: ``lockstep web --port 0`` as a process, killed at teardown."""
    procs: list[subprocess.Popen] = []

    def _start(dsn: str, *args: str) -> str:
        log = tmp_path / f"web{len(procs)}.log"
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "lockstep", "web", "--dsn", dsn, "--port", "0", *args],
                    stdout=subprocess.DEVNULL,
                    stderr=f,
                )
            )
        found = wait_for(
            lambda: re.search(r"serving (http://\S+/)", log.read_text()) or procs[-1].poll() is not None,
            timeout=30,
            what="lockstep web to listen",
        )
        assert procs[-1].poll() is None, log.read_text()
        return found.group(1)

    yield _start
    for p in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def text(driver, css: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css).text


def test_the_page_in_chromium_while_a_runner_works(ex, example_dsn, runners, browser, web_server, tmp_path):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    # some history first: worker passes of different sizes (the charts), then the workload
    for n in (5, 40, 12, 80, 25, 60):
        ex.execute(
            "update example.exam_item set body = body || ' x' where exam_id between 60 and %s", [n + 60]
        )
        ex.execute("select lockstep.work('exam_keys')")
    setup_workload(ex)  # exam_keys: 32 queued keys, the parked one's counted; ok done; boom failed
    ex.execute(TICK)
    ex.execute("update lockstep.job_state set next_run_at = now() where job = 'boom'")
    # the runner works tick (every second) and boom (fails again); exam_keys is left alone, so its
    # queue depth stays what the test made it
    runner = runners(example_dsn, "--job", "tick", "--job", "boom", "--tick", "0.2")
    wait_for(
        lambda: ex.execute(
            "select count(*) = 2 from lockstep.job_state where (job = 'boom' and runs >= 2)"
            " or (job = 'tick' and runs >= 2)"
        ).fetchone()[0],
        timeout=30,
        what="the runner to run boom and tick",
    )
    url = web_server(example_dsn, "--refresh", "1")
    assert url.startswith("http://127.0.0.1:")  # the default --host

    browser.get(url)
    # the page reloads itself every second: an element read mid-reload is gone or stale, read it again
    wait = WebDriverWait(
        browser, 20, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
    )

    def shown(css: str) -> str:
        return wait.until(lambda d: [text(d, css)])[0]

    def attrs(css: str, name: str) -> list[str]:
        found = wait.until(lambda d: [[e.get_attribute(name) for e in d.find_elements(By.CSS_SELECTOR, css)]])
        return found[0]

    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-job="tick"]'))
    assert attrs("#jobs tr[data-job]", "data-job") == ["boom", "exam_keys", "ok", "tick"]
    assert shown('tr[data-job="exam_keys"] .queue-depth') == "32"
    assert shown("#queue-total") == "32"
    assert shown('tr[data-job="boom"] .last-error') == "boom: the disk is on fire"
    assert shown('tr[data-job="boom"] .consecutive-failures') == "2"
    assert shown('tr[data-job="tick"] .last-outcome').startswith("done")
    assert "tick" in attrs("#runs tr[data-job]", "data-job")  # the history, live
    assert attrs("#keys tr[data-key]", "data-key") == ["42", "13"]

    # the page reloads itself: more queued keys show up without the test reloading it
    first = shown("#generated-at")
    ex.execute("select lockstep.enqueue('exam_keys', array[500, 501, 502, 503]::bigint[])")
    wait.until(lambda d: text(d, 'tr[data-job="exam_keys"] .queue-depth') == "36")
    assert shown("#generated-at") != first
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, 'svg[aria-label="queue depth over time"]'))
    assert runner.proc.poll() is None, runner.stderr

    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, min(int(height) + 40, 2400))
    shot = tmp_path / "web.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("LOCKSTEP_WEB_SCREENSHOT"):
        shutil.copy(shot, os.environ["LOCKSTEP_WEB_SCREENSHOT"])
