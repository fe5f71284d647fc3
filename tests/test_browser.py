"""The course as a learner meets it: every lesson run in a real JupyterLab, in Chromium.

nbval runs the lessons' code but renders no widget; this test opens each lesson in
JupyterLab (its own server, on a copy of lessons/), runs Run → Run All Cells, and fails on
a cell that did not run, an error output, a traceback on stderr or in the log console
(where widget callbacks' errors go), a widget that failed to render, or a browser console
error.  In the explorer it moves the devices and micro-batches sliders from the keyboard
and checks that the timeline redraws and the bubble shown is (p-1)/(m+p-1) for the
values the sliders show; it prints the key press → new picture latency at the largest
p and m (not asserted: it depends on the machine).

Needs the distribution's Chromium (`apt-get install chromium`; or $PIPELAB_CHROMIUM) and
Playwright (the dev extra); skipped without them, except under PIPELAB_BROWSER_REQUIRED=1
(.ci/run sets it), where that is a failure.  `make screenshots` (PIPELAB_SCREENSHOTS=docs)
also writes the README's screenshots to docs/, and fails too when there is no browser.
Helpers: tests/browser_lab.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

import pytest

import browser_lab

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
LESSON_SECONDS = 150  # a lesson must run "well under two minutes" on 2 cores
SCREENSHOTS = os.environ.get("PIPELAB_SCREENSHOTS")  # a directory (relative to the repository), or unset
# Lessons whose screenshot goes to the README: the picture of the first code cell that
# contains this text and draws one (the lesson's first picture if none does).
SCREENSHOT_CELLS = {"03_gpipe.ipynb": "pl.plot.timeline(", "06_one_process_to_many.ipynb": "pl.plot.stacked("}
VIEWPORT = {"width": 1280, "height": 900}
EXPLORER_NOTEBOOK = "explorer_check.ipynb"
LATENCY_PRESSES = 8

pytestmark = pytest.mark.browser


def _missing() -> str | None:
    """Why the browser test cannot run here, or None."""
    if browser_lab.chromium_path() is None:
        return "no Chromium (apt-get install chromium, or set PIPELAB_CHROMIUM to its executable)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("browser")


@pytest.fixture(scope="module")
def browser(scratch):
    missing = _missing()
    if missing and (SCREENSHOTS or os.environ.get("PIPELAB_BROWSER_REQUIRED")):
        asked = "PIPELAB_SCREENSHOTS" if SCREENSHOTS else "PIPELAB_BROWSER_REQUIRED (.ci/run)"
        pytest.fail(f"{asked} is set but the browser test cannot run: {missing}")
    if missing:
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright, \
            browser_lab.chromium(playwright, scratch, browser_lab.chromium_path(), VIEWPORT) as context:
        yield context


@pytest.fixture(scope="module")
def lab(browser, scratch):
    """A JupyterLab server on a copy of lessons/ (plus the explorer's notebook): nothing
    the lessons write lands in the checkout."""
    course = scratch / "course"
    shutil.copytree(ROOT / "lessons", course, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    (course / EXPLORER_NOTEBOOK).write_text(json.dumps(_explorer_notebook()))
    with browser_lab.jupyterlab(course, scratch / "jupyter") as server:
        yield server


def _explorer_notebook() -> dict:
    cell = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
            "source": "import pipelab as pl\n\npl.widgets.explorer()"}
    return {"nbformat": 4, "nbformat_minor": 5, "cells": [cell],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}


@pytest.fixture
def page(browser, lab):
    """A fresh tab; `page.console_errors` collects console errors and uncaught exceptions.
    Its notebook's kernel is shut down after the test (ten idle kernels hold gigabytes)."""
    tab = browser.new_page()
    tab.console_errors = []
    tab.on("console", lambda message: tab.console_errors.append(f"console.{message.type}: {message.text}")
           if message.type == "error" else None)
    tab.on("pageerror", lambda error: tab.console_errors.append(f"uncaught: {error}"))
    yield tab
    browser_lab.shut_down_kernel_soon(tab, lab)
    tab.close()


def _log_console_errors(page) -> list[str]:
    """Entries of JupyterLab's log console (outputs of widget callbacks) that show an error."""
    page.evaluate("() => window.jupyterapp.commands.execute('logconsole:open', {insertMode: 'split-bottom'})")
    page.wait_for_selector(".jp-LogConsolePanel", state="attached", timeout=10_000)
    entries = page.eval_on_selector_all(".jp-LogConsolePanel .jp-OutputArea-output",
                                        "(nodes) => nodes.map((node) => node.textContent)")
    return [text[-500:] for text in entries if re.search(r"Error|Traceback", text)]


def _screenshot_path(name: str) -> Path:
    directory = Path(SCREENSHOTS)
    return (directory if directory.is_absolute() else ROOT / directory) / name


@pytest.mark.parametrize("lesson", [p.name for p in LESSONS])
def test_lesson_runs_in_jupyterlab(lab, page, lesson):
    begin = time.perf_counter()
    browser_lab.open_notebook(page, lab, lesson, workspace=lesson.split("_")[0])
    state = browser_lab.run_all_cells(page, timeout_seconds=LESSON_SECONDS)
    seconds = time.perf_counter() - begin
    if SCREENSHOTS and lesson in SCREENSHOT_CELLS:
        _lesson_screenshot(page, state, SCREENSHOT_CELLS[lesson], _screenshot_path(f"lesson_{Path(lesson).stem}.png"))
    problems = browser_lab.problems_in(state)
    problems += [f"on the page: {text}" for text in page.evaluate(browser_lab.PAGE_ERRORS)]
    problems += [f"log console: {text}" for text in _log_console_errors(page)]
    problems += page.console_errors
    assert state["cells"], f"{lesson}: no code cells found in JupyterLab"
    assert not problems, f"{lesson} in JupyterLab ({seconds:.0f} s):\n" + "\n".join(problems)


def _lesson_screenshot(page, state: dict, code_text: str, path: Path) -> None:
    """The viewport with the chosen code cell's picture at its bottom and the code above it."""
    index = next((i for i, cell in enumerate(state["cells"])
                  if code_text in cell["source"] and _has_picture(cell)), None)
    if index is None:  # the lesson changed: its first picture instead
        index = next(i for i, cell in enumerate(state["cells"]) if _has_picture(cell))
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    page.evaluate("""(codeIndex) => {
        const notebook = window.jupyterapp.shell.currentWidget.content;
        const cells = notebook.widgets;
        const target = cells.filter((cell) => cell.model.type === 'code')[codeIndex];
        notebook.activeCellIndex = cells.indexOf(target);
        const picture = target.node.querySelector('.jp-OutputArea-output img');
        const fits = picture.getBoundingClientRect().height < notebook.node.getBoundingClientRect().height;
        picture.scrollIntoView({block: fits ? 'end' : 'start'});
    }""", index)
    page.wait_for_timeout(800)
    browser_lab.save_small_png(page.screenshot(), path)
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")


def _has_picture(cell: dict) -> bool:
    return any("image/png" in output.get("data", {}) for output in cell["outputs"])


# The explorer: its sliders (found by their labels), its pictures and its text.
EXPLORER = """() => {
  const root = [...document.querySelectorAll('.jp-OutputArea-output')]
    .find((node) => node.querySelector('.widget-slider'));
  if (!root) return null;
  const slider = (pattern) => [...root.querySelectorAll('.widget-slider')]
    .find((node) => pattern.test(node.querySelector('.widget-label').textContent));
  const value = (node) => node && Number(node.querySelector('.widget-readout').textContent);
  const devices = slider(/device/i), microbatches = slider(/micro/i);
  const pictures = [...root.querySelectorAll('img')].filter((img) => img.offsetParent !== null);
  const fingerprint = (img) => {  // a checksum of the decoded pixels and the count of dark ones
    const canvas = document.createElement('canvas');
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    const context = canvas.getContext('2d');
    context.drawImage(img, 0, 0);
    const pixels = context.getImageData(0, 0, canvas.width, canvas.height).data;
    let sum = 0, dark = 0;
    for (let i = 0; i < pixels.length; i += 4) {
      sum = (sum * 31 + pixels[i] + 7 * pixels[i + 1] + 13 * pixels[i + 2]) % 1000000007;
      if (pixels[i] < 200) dark += 1;
    }
    return {src: img.src, width: img.naturalWidth, height: img.naturalHeight, sum, dark};
  };
  return {
    devices: value(devices), microbatches: value(microbatches),
    text: [...root.querySelectorAll('.widget-html-content')].map((node) => node.textContent).join(' | '),
    pictures: pictures.map(fingerprint),
  };
}"""


def _explorer(page) -> dict:
    state = page.evaluate(EXPLORER)
    assert state is not None, "the explorer's sliders are not on the page"
    return state


def _shows_percentage(text: str, fraction: float) -> bool:
    """True if `text` prints `fraction` as a percentage, to the precision it is printed with."""
    for number, decimals in re.findall(r"(\d+(?:\.(\d+))?)\s*%", text):
        if abs(float(number) - 100 * fraction) <= 0.5 * 10 ** -len(decimals) + 1e-9:
            return True
    return False


def _bubble(devices: int, microbatches: int) -> float:
    """(p-1)/(m+p-1): GPipe (Huang et al. 2019) §2.3; Megatron-LM (Narayanan et al. 2021) §2.2.1."""
    return (devices - 1) / (microbatches + devices - 1)


def _slider_handle(page, label_pattern: str):
    """The handle of the first slider whose label matches (as EXPLORER reads them)."""
    label = page.locator(".widget-label", has_text=re.compile(label_pattern, re.I))
    return page.locator(".jp-OutputArea-output .widget-slider", has=label).first.locator(".noUi-handle")


def _press_and_wait(page, label_pattern: str, key: str, before: dict) -> dict:
    """Press `key` on the handle of the slider whose label matches; wait for the redraw."""
    handle = _slider_handle(page, label_pattern)
    handle.focus()
    page.keyboard.press(key)
    page.wait_for_function("""(oldSrc) => {
        const img = [...document.querySelectorAll('.jp-OutputArea-output img')].find((i) => i.offsetParent !== null);
        return img && img.src !== oldSrc && img.complete;
    }""", arg=before["pictures"][0]["src"], timeout=20_000, polling=50)
    browser_lab.wait_kernel_idle(page)
    return _explorer(page)


def test_explorer_in_jupyterlab(lab, page, capsys):
    page.set_viewport_size({"width": 1280, "height": 1300})  # room for the explorer, for its screenshot
    browser_lab.open_notebook(page, lab, EXPLORER_NOTEBOOK, workspace="explorer")
    state = browser_lab.run_all_cells(page, timeout_seconds=60)
    assert not browser_lab.problems_in(state), browser_lab.problems_in(state)
    page.wait_for_function("() => [...document.querySelectorAll('.jp-OutputArea-output img')]"
                           ".some((img) => img.offsetParent !== null && img.complete && img.naturalWidth > 0)",
                           timeout=30_000)
    first = _explorer(page)
    assert first["devices"] and first["microbatches"], f"slider values not read: {first}"
    assert _shows_percentage(first["text"], _bubble(first["devices"], first["microbatches"])), first["text"]

    if SCREENSHOTS:
        _explorer_screenshot(page, _screenshot_path("explorer.png"))
    _run_for_real(page)
    first = _explorer(page)

    steps = [("device", "End"), ("micro", "End")]  # the largest p, then the largest m
    before = first
    for label, key in steps:
        after = _press_and_wait(page, label, key, before)
        moved = "devices" if label == "device" else "microbatches"
        assert after[moved] != before[moved], f"{key} on the {moved} slider left it at {before[moved]}"
        timeline_before, timeline_after = before["pictures"][0], after["pictures"][0]
        assert timeline_after["src"] != timeline_before["src"], "the timeline picture was not replaced"
        assert (timeline_after["sum"], timeline_after["width"]) != (timeline_before["sum"], timeline_before["width"]), \
            "the timeline picture was replaced by the same pixels"
        expected = _bubble(after["devices"], after["microbatches"])
        assert _shows_percentage(after["text"], expected), (
            f"sliders show p={after['devices']}, m={after['microbatches']}: the text should show "
            f"(p-1)/(m+p-1) = {expected:.1%}; it reads {after['text']!r}")
        assert all(picture["dark"] > 1000 for picture in after["pictures"]), \
            f"a blank picture: dark pixels {[p['dark'] for p in after['pictures']]}"
        before = after

    first_picture, all_pictures = _latencies(page)
    last = _explorer(page)  # the last of the quick presses shows its own values, not an earlier frame's
    assert _shows_percentage(last["text"], _bubble(last["devices"], last["microbatches"])), (
        f"after the last press the sliders show p={last['devices']}, m={last['microbatches']}, the text {last['text']!r}")
    with capsys.disabled():
        print(f"\nexplorer in JupyterLab, p={before['devices']}, m={before['microbatches'] - 1} down to "
              f"{before['microbatches'] - LATENCY_PRESSES}: key press -> new timeline median "
              f"{statistics.median(first_picture):.0f} ms (min {min(first_picture):.0f}, max {max(first_picture):.0f}), "
              f"-> last picture median {statistics.median(all_pictures):.0f} ms "
              f"(min {min(all_pictures):.0f}, max {max(all_pictures):.0f}); {LATENCY_PRESSES} presses, target <= 150 ms")
    problems = [f"log console: {text}" for text in _log_console_errors(page)] + page.console_errors
    assert not problems, "\n".join(problems)


# Times each key press and each load of a picture in the explorer, on the page's clock.
LATENCY_PROBE = """() => {
  const root = [...document.querySelectorAll('.jp-OutputArea-output')].find((n) => n.querySelector('.widget-slider'));
  const pictures = [...root.querySelectorAll('img')];
  window.pipelabProbe = {pressed: null, loads: []};
  pictures.forEach((img, index) => img.addEventListener('load', () => {
    window.pipelabProbe.loads.push({index, at: performance.now()});
  }));
  root.addEventListener('keydown', () => {
    window.pipelabProbe.pressed = performance.now();
    window.pipelabProbe.loads = [];
  }, true);
}"""
TIMELINE_LOADED = "() => window.pipelabProbe.loads.some((load) => load.index === 0)"
QUIET_MS = 300  # no picture loaded for this long (and the kernel idle): the redraw is over
QUIET = f"""() => performance.now() - Math.max(...window.pipelabProbe.loads.map((load) => load.at)) > {QUIET_MS}"""


def _latencies(page) -> tuple[list[float], list[float]]:
    """Key press -> new timeline, and -> the last picture redrawn, in ms: m one lower at each press
    (values the explorer has not shown yet, so no picture can come from a cache)."""
    page.evaluate(LATENCY_PROBE)
    handle = _slider_handle(page, "micro")
    first_picture, all_pictures = [], []
    for press in range(LATENCY_PRESSES):
        handle.focus()
        page.keyboard.press("ArrowLeft")
        page.wait_for_function(TIMELINE_LOADED, timeout=20_000, polling=20)
        browser_lab.wait_kernel_idle(page)
        page.wait_for_function(QUIET, timeout=20_000, polling=50)
        probe = page.evaluate("() => window.pipelabProbe")
        first_picture.append(min(load["at"] for load in probe["loads"] if load["index"] == 0) - probe["pressed"])
        all_pictures.append(max(load["at"] for load in probe["loads"]) - probe["pressed"])
    return first_picture, all_pictures


def _run_for_real(page) -> None:
    """Press "run it for real": a picture more appears (predicted above measured), with ink on it."""
    shown = len(_explorer(page)["pictures"])
    page.get_by_role("button", name=re.compile("for real", re.I)).click()
    page.wait_for_function(f"""() => {{
        const root = [...document.querySelectorAll('.jp-OutputArea-output')].find((n) => n.querySelector('.widget-slider'));
        return [...root.querySelectorAll('img')].filter((img) => img.offsetParent !== null && img.complete
                                                         && img.naturalWidth > 0).length > {shown};
    }}""", timeout=90_000, polling=200)
    browser_lab.wait_kernel_idle(page, timeout_seconds=90)
    pictures = _explorer(page)["pictures"]
    assert all(picture["dark"] > 1000 for picture in pictures), \
        f"a blank picture after the real run: dark pixels {[p['dark'] for p in pictures]}"


def _explorer_screenshot(page, path: Path) -> None:
    """The explorer's output area and a margin around it, with the file browser closed."""
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    area = page.locator(".jp-OutputArea-output", has=page.locator(".widget-slider")).first
    area.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    box, margin = area.bounding_box(), 12
    clip = {"x": max(box["x"] - margin, 0), "y": max(box["y"] - margin, 0),
            "width": box["width"] + 2 * margin, "height": box["height"] + 2 * margin}
    browser_lab.save_small_png(page.screenshot(clip=clip), path)
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
