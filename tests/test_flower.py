"""Flower runs on the preheat app, with basic auth from the environment, and never without."""

import subprocess
import sys

import httpx
import pytest

from preheat.core import processes

pytestmark = pytest.mark.slow


def test_flower_serves_with_basic_auth_only(services_stack, tmp_path):
    port = processes.free_port()
    env = {**services_stack.env, "FLOWER_BASIC_AUTH": "admin:correct-horse"}
    flower = processes.start(
        "flower", processes.celery_command("flower", f"--port={port}", "--address=127.0.0.1"), env, tmp_path / "logs"
    )
    with processes.running(flower):
        processes.wait_for_log(flower, "Visit me at", timeout_s=60)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/healthcheck", timeout=10).status_code == 200
        assert httpx.get(f"{base}/api/workers", timeout=10).status_code == 401
        assert httpx.get(f"{base}/tasks", timeout=10).status_code == 401
        assert httpx.get(f"{base}/tasks", auth=("admin", "wrong"), timeout=10).status_code == 401
        assert httpx.get(f"{base}/tasks", auth=("admin", "correct-horse"), timeout=10).status_code == 200
    assert "correct-horse" not in flower.log()


@pytest.mark.parametrize(
    ("args", "auth_env", "message"),
    [
        ([], {}, "Flower needs auth: set FLOWER_BASIC_AUTH"),
        ([], {"FLOWER_BASIC_AUTH": "admin:correct-horse,"}, "FLOWER_BASIC_AUTH: entry 2 is empty"),
        (["--basic-auth="], {}, "--basic-auth: entry 1 is empty"),
        (["--auth="], {}, "--auth is empty"),
    ],
)
def test_flower_without_a_real_credential_refuses_to_start(services_stack, args, auth_env, message):
    env = {k: v for k, v in services_stack.env.items() if not k.startswith("FLOWER_")}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "preheat", "flower", "--port=1", *args],
        env={**env, **auth_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "correct-horse" not in done.stderr


def _chromium(tmp_path):
    """Debian's headless Chromium through its chromedriver (installed by `make browser`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,900",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def test_the_warmup_task_shows_in_flower_in_a_browser_and_in_its_api(services_stack, tmp_path):
    import base64

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    port = processes.free_port()
    env = {**services_stack.env, "FLOWER_BASIC_AUTH": "admin:correct-horse"}
    flower = processes.start(
        "flower", processes.celery_command("flower", f"--port={port}", "--address=127.0.0.1"), env, tmp_path / "logs"
    )
    worker = processes.start_worker("w1@flower-test", services_stack.env, tmp_path / "logs", cwd=services_stack.home)
    with processes.running(flower, worker):
        processes.wait_for_log(flower, "Visit me at", timeout_s=60)
        processes.wait_for_log(worker, "w1@flower-test ready.")
        done = services_stack.cli("warm", "--wait", "--json", "--timeout", "120")
        assert done.returncode == 0, done.stderr
        run_prefix = done.stdout.split('"id": "')[1][:8]
        kwargs_shown = f"run={run_prefix} worker=w1@flower-test templates=support"

        base = f"http://127.0.0.1:{port}"

        def succeeded_warmups():
            tasks = httpx.get(f"{base}/api/tasks", auth=("admin", "correct-horse"), timeout=10).json()
            found = [{**task, "uuid": uuid} for uuid, task in tasks.items() if task["name"] == "preheat.warm_worker"]
            return found if found and all(task["state"] == "SUCCESS" for task in found) else None

        # History is final before the task returns; Flower hears of its success a moment later.
        warmups = processes.poll(succeeded_warmups, 15, what="Flower seeing the task succeed")
        assert [task["kwargs"] for task in warmups] == [kwargs_shown]  # readable, not a blob

        browser = _chromium(tmp_path)
        try:
            credentials = base64.b64encode(b"admin:correct-horse").decode()
            browser.execute_cdp_cmd("Network.enable", {})
            browser.execute_cdp_cmd(
                "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {credentials}"}}
            )
            browser.get(f"{base}/tasks")
            WebDriverWait(browser, 30).until(lambda b: "preheat.warm_worker" in b.page_source)
            screenshot = tmp_path / "flower-tasks.png"
            assert browser.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
            # The task's own page shows its arguments as the readable line the sender set.
            browser.find_element(By.LINK_TEXT, warmups[0]["uuid"]).click()
            WebDriverWait(browser, 30).until(lambda b: kwargs_shown in b.page_source)
            assert browser.save_screenshot(str(tmp_path / "flower-task.png"))
        finally:
            browser.quit()
        assert httpx.get(f"{base}/tasks", timeout=10).status_code == 401  # the browser had credentials; we don't
