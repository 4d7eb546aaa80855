"""`preheat report`: one HTML file that opens offline in a real browser, every plot drawn,
nothing fetched; bad input is one line."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from preheat.core import processes
from preheat.history.db import session_scope, utcnow
from preheat.history.models import Schedule, ScheduleKind, ScheduleSlot, SlotStatus, TrafficCount
from tests.test_flower import _chromium


@pytest.mark.slow
def test_the_report_opens_in_a_browser_with_every_plot_drawn_and_nothing_fetched(embedded_stack, tmp_path):
    from selenium.webdriver.common.by import By

    now = utcnow()
    with session_scope() as session:  # traffic, a learned peak and its fire in the last hour
        for minute in range(30):
            at = (now - dt.timedelta(minutes=minute)).replace(second=0, microsecond=0)
            session.add(TrafficCount(minute=at, model="tiny", template="support", requests=5 + minute % 7))
            session.add(TrafficCount(minute=at, model="acme", template="", requests=2 + minute % 3))  # an adapter
        peak = Schedule(
            name="peak-tiny",
            kind=ScheduleKind.peak,
            cron="0 9 * * *",
            targets={"templates": ["support"]},
            lead_time_s=300,
            detail={"starts": "09:00", "ends": "09:15"},
        )
        session.add(peak)
        session.flush()
        session.add(
            ScheduleSlot(
                schedule_id=peak.id,
                schedule_name="peak-tiny",
                slot_at=now - dt.timedelta(minutes=15),
                fire_at=now - dt.timedelta(minutes=20),
                status=SlotStatus.sent,
            )
        )
    worker = processes.start_worker("w1@report", embedded_stack.env, tmp_path / "logs", cwd=embedded_stack.home)
    with processes.running(worker):
        processes.wait_for_log(worker, "w1@report ready.")
        for _ in range(2):
            done = embedded_stack.cli("warm", "--wait", "--json")
            assert done.returncode == 0, done.stderr
    out = tmp_path / "report.html"
    written = embedded_stack.cli("report", "--since", "1h", "--out", str(out))
    assert written.returncode == 0 and "2 job(s)" in written.stdout, written.stderr
    page = out.read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page

    browser = _chromium(tmp_path)
    try:
        browser.get(out.as_uri())
        figures = browser.find_elements(By.CSS_SELECTOR, "figure")
        assert [f.get_attribute("id") for f in figures] == ["ttft-0", "verdicts", "schedules", "by-name", "kv-bytes"]
        assert "acme" in browser.find_element(By.ID, "by-name").text  # the adapter's own line
        for figure in figures:
            plot = figure.find_element(By.CSS_SELECTOR, "svg.plot")
            assert plot.size["width"] > 800 and plot.size["height"] > 200, figure.get_attribute("id")
            drawn = plot.find_elements(By.CSS_SELECTOR, ".series")
            assert any(element.is_displayed() for element in drawn), figure.get_attribute("id")
            assert "nothing recorded" not in plot.text
        assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
        verdicts = browser.find_element(By.ID, "verdicts")
        assert "w1@report" in verdicts.text and not re.search(r"\d\d:\d\d", verdicts.text)  # no time axis
        # Cold, warm and bare told apart: each its colour and its marker, a legend saying which.
        ttft = browser.find_element(By.ID, "ttft-0")
        drawn = {
            (shape, element.get_attribute("fill"))
            for shape in ("rect", "circle", "polygon")
            for element in ttft.find_elements(By.CSS_SELECTOR, f"svg.plot {shape}.series")
        }
        assert len(drawn) == 3 and len({fill for _, fill in drawn}) == 3, drawn
        legend = ttft.find_element(By.CSS_SELECTOR, ".legend").text
        assert "cold: full prefill" in legend and "warm: from the cached prefix" in legend and "bare:" in legend
        # The time axis fitted to the warmups (two runs minutes apart), not the hour asked for.
        labels = [
            e.text
            for e in ttft.find_elements(By.CSS_SELECTOR, "svg.plot text")
            if re.fullmatch(r"\d\d:\d\d:\d\d", e.text)
        ]
        first, last = (dt.datetime.strptime(label, "%H:%M:%S") for label in (labels[0], labels[-1]))
        assert 60 <= (last - first).total_seconds() <= 1800, labels
        browser.save_screenshot(str(tmp_path / "report.png"))
    finally:
        browser.quit()


@pytest.mark.parametrize(
    ("args", "message"),
    [(("--since", "soon"), "--since"), (("--since", "1h", "--out", "."), "is a folder")],
)
def test_bad_input_is_one_line_and_nothing_is_written(embedded_stack, args, message):
    done = embedded_stack.cli_here("report", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
