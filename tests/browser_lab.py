"""JupyterLab in the system Chromium, for tests/test_browser.py.

`jupyterlab(root_dir, scratch)` starts a private JupyterLab server: a free loopback port, a
random token, and every per-user directory (config, runtime, data, settings, workspaces,
IPython) under `scratch`, so neither the learner's settings nor the checkout are touched.
The widgets extension still loads: it is installed in the environment's share/jupyter,
which JupyterLab reads whatever these variables say.  The server runs in its own process
group and is stopped by that id, whatever happened.

`chromium(scratch)` launches the distribution's Chromium through Playwright, by its
executable path (no browser is downloaded), with a fresh profile under `scratch` and the
switches that keep it off the network.

The `NOTEBOOK_STATE` script reads a notebook's state from JupyterLab's own models (the
server is started with `expose_app_in_browser`, which puts the app at `window.jupyterapp`):
the kernel's status, each code cell's execution count and outputs.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# Off the network (CI and this machine have none): no QUIC, no background fetches, no
# component updates, no sync; no sandbox and no GPU, as root in a container.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

SERVER_START_SECONDS = 60


def chromium_path() -> str | None:
    """The system Chromium: $PIPELAB_CHROMIUM, else `chromium` on PATH, else /usr/bin/chromium."""
    for candidate in (os.environ.get("PIPELAB_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port() -> int:
    """A loopback port nobody listens on now (the server is told not to try others)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Lab:
    base_url: str
    token: str
    root_dir: Path
    pid: int
    pending: list = field(default_factory=list)  # threads still shutting kernels down

    def notebook_url(self, path: str, workspace: str) -> str:
        """Opens `path` in its own fresh workspace (tabs of one browser do not share a layout)."""
        return f"{self.base_url}/lab/workspaces/{workspace}/tree/{path}?reset&token={self.token}"


# User settings of the private server: no "get notified about Jupyter news?" toast (and no
# request for news), nothing else changed.
SETTINGS = {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            '{"fetchNews": "false", "checkForUpdates": false}'}


@contextmanager
def jupyterlab(root_dir: Path, scratch: Path):
    """A JupyterLab server on `root_dir`, stopped (its whole process group) on exit."""
    dirs = {name: scratch / name for name in ("config", "runtime", "data", "settings", "workspaces", "ipython")}
    for directory in dirs.values():
        directory.mkdir(parents=True, exist_ok=True)
    for relative, text in SETTINGS.items():
        path = dirs["settings"] / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
               JUPYTER_DATA_DIR=str(dirs["data"]), JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]),
               JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]), IPYTHONDIR=str(dirs["ipython"]))
    env.pop("JUPYTER_PATH", None)
    port, token = free_port(), secrets.token_hex(16)
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
               f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={root_dir}", "--LabApp.expose_app_in_browser=True"]
    log_path = scratch / "jupyterlab.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, cwd=root_dir, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_until_up(server, f"{base_url}/api/status?token={token}", log_path)
        lab = Lab(base_url, token, root_dir, server.pid)
        yield lab
        for thread in lab.pending:
            thread.join(timeout=30)
    finally:
        stop_server(server)


def _wait_until_up(server: subprocess.Popen, status_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {server.returncode} before answering; its log:\n"
                               + log_path.read_text()[-3000:])
        try:
            with urllib.request.urlopen(status_url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer {status_url} within {SERVER_START_SECONDS} s; its log:\n"
                       + log_path.read_text()[-3000:])


def stop_server(process: subprocess.Popen, grace_seconds: float = 10) -> None:
    """SIGTERM to the server's process group (SIGKILL after the grace), then its kernels.

    jupyter_client starts each kernel in a session of its own, so the kernels are not in the
    server's group: they are found (as the server's children) before it stops, and killed
    by their ids if the server's own shutdown left any running.
    """
    try:
        kernels = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kernels = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(grace_seconds)
            break
        except subprocess.TimeoutExpired:
            continue
    for kernel in kernels:
        try:
            kernel.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(kernels, timeout=grace_seconds)


@contextmanager
def chromium(playwright, scratch: Path, executable: str, viewport: dict):
    """A Chromium context with a fresh profile in `scratch`; closed (and the profile removed) on exit."""
    profile = scratch / "chromium-profile"
    context = playwright.chromium.launch_persistent_context(
        str(profile), executable_path=executable, args=CHROMIUM_ARGS, headless=True, viewport=viewport)
    try:
        yield context
    finally:
        context.close()
        shutil.rmtree(profile, ignore_errors=True)


WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

# Kernel status and every code cell as JupyterLab's models hold them (one notebook per page).
NOTEBOOK_STATE = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = panel.content.widgets.filter((cell) => cell.model.type === 'code');
  return {
    kernel: kernel ? kernel.status : 'none',
    path: panel.context.path,
    cells: cells.map((cell) => ({
      source: cell.model.sharedModel.getSource(),
      execution_count: cell.model.executionCount,
      running: cell.promptNode ? cell.promptNode.textContent.includes('*') : false,
      outputs: cell.model.outputs.toJSON(),
      widget_views: [...cell.outputArea.node.querySelectorAll(':scope > .jp-OutputArea-child > .jp-OutputArea-output')]
        .filter((output) => output.querySelector('.jupyter-widgets')).length,
    })),
  };
}"""

KERNEL_IDLE = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const session = panel && panel.sessionContext && panel.sessionContext.session;
  return Boolean(session && session.kernel && session.kernel.status === 'idle' && panel.context.isReady);
}"""


def open_notebook(page, lab: Lab, path: str, workspace: str, timeout_seconds: float = 60) -> None:
    """Open `path` and wait until its kernel is idle."""
    page.goto(lab.notebook_url(path, workspace))
    page.wait_for_function(KERNEL_IDLE, timeout=timeout_seconds * 1000, polling=200)


def wait_kernel_idle(page, timeout_seconds: float = 30) -> None:
    page.wait_for_function(KERNEL_IDLE, timeout=timeout_seconds * 1000, polling=50)


def shut_down_kernel_soon(page, lab: Lab) -> None:
    """Shut down the kernel of the page's notebook (if any) in the background: the server
    takes a second or two, which the next lesson need not wait for."""
    session = page.evaluate("""() => {
        const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        const session = panel && panel.sessionContext && panel.sessionContext.session;
        return session ? session.id : null;
    }""")
    if session is not None:
        request = urllib.request.Request(f"{lab.base_url}/api/sessions/{session}", method="DELETE",
                                         headers={"Authorization": f"token {lab.token}"})
        thread = threading.Thread(target=_send_quietly, args=(request,), daemon=True)
        thread.start()
        lab.pending.append(thread)


def _send_quietly(request: urllib.request.Request) -> None:
    try:
        with urllib.request.urlopen(request, timeout=30):
            pass
    except OSError:
        pass  # the server stops (and kills its kernels) at the end anyway


def run_all_cells(page, timeout_seconds: float) -> dict:
    """Run → Run All Cells, then wait until no cell runs, the kernel is idle and the widgets
    are drawn: the state then."""
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    deadline = time.monotonic() + timeout_seconds
    state = None
    while time.monotonic() < deadline:
        time.sleep(0.5)
        state = page.evaluate(NOTEBOOK_STATE)
        if state and state["kernel"] == "idle" and not any(cell["running"] for cell in state["cells"]):
            return _with_widgets_drawn(page, state)
    running = [i for i, cell in enumerate(state["cells"]) if cell["running"]] if state else "?"
    raise TimeoutError(f"cells {running} still running after {timeout_seconds:.0f} s")


def _with_widgets_drawn(page, state: dict, timeout_seconds: float = 15) -> dict:
    """The state once every widget output has its view drawn (views render after their cell
    finished), or after the timeout (then problems_in reports the ones missing)."""
    deadline = time.monotonic() + timeout_seconds
    while _widgets_missing(state) and time.monotonic() < deadline:
        time.sleep(0.2)
        state = page.evaluate(NOTEBOOK_STATE)
    return state


def _widgets_missing(state: dict) -> bool:
    return any(cell["widget_views"] < _widget_outputs(cell) for cell in state["cells"])


def _widget_outputs(cell: dict) -> int:
    return sum(WIDGET_MIME in output.get("data", {}) for output in cell["outputs"])


def problems_in(state: dict) -> list[str]:
    """What a learner would see as a failure: cells not run, error outputs, tracebacks on
    stderr, widgets shown as text instead of drawn."""
    found = []
    for index, cell in enumerate(state["cells"]):
        first_line = cell["source"].strip().splitlines()[0][:60] if cell["source"].strip() else ""
        where = f"code cell {index} ({first_line!r})"
        for output in cell["outputs"]:
            if output["output_type"] == "error":
                lines = _plain("\n".join(output["traceback"])).splitlines()
                failing = [line.strip() for line in lines if re.match(r"\s*-+> ", line)]  # IPython's "---> 12 ..."
                found.append(f"{where}: {output['ename']}: {output['evalue']}"
                             + (f" at {failing[-1]}" if failing else ""))
            elif output["output_type"] == "stream" and output["name"] == "stderr":
                text = "".join(output["text"]) if isinstance(output["text"], list) else output["text"]
                if "Traceback" in text or "Error" in text:
                    found.append(f"{where} wrote an error to stderr: {text[-500:]}")
        widgets = _widget_outputs(cell)
        if cell["widget_views"] < widgets:  # e.g. the widgets extension did not load: a text repr instead
            found.append(f"{where}: {widgets - cell['widget_views']} of its {widgets} widgets not rendered")
    not_run = [index for index, cell in enumerate(state["cells"]) if cell["execution_count"] is None]
    if not_run:
        found.append(f"code cells {not_run} (of {len(state['cells'])}) did not run")
    return found


def _plain(text: str) -> str:
    """A traceback line without its terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


# Widget views that failed to render, and errors inside widgets' own output areas (an
# `interactive` shows its function's exception there, not in the cell's outputs).
PAGE_ERRORS = """() => [...document.querySelectorAll('.jupyter-widgets-error-widget, '
    + '.widget-output .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .map((node) => node.textContent.slice(-500))"""


def save_small_png(png: bytes, path: Path, colors: int = 128) -> int:
    """Write a screenshot as a palette PNG (a few hundred KB becomes well under 300 KB)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)
    return path.stat().st_size
