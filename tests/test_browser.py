"""A real-browser test (issue 5): notebook 05's slider, moved in JupyterLab in headless Chromium.

The test copies ``notebooks/05-*.ipynb`` into a temporary folder with ``INTERACTIVE=True`` injected after its
``parameters`` cell (papermill's parameterize-only step; ``SMOKE=True`` stays, so it runs in seconds), starts
JupyterLab on 127.0.0.1 with a random token, opens the notebook in a Chromium driven by Playwright (nothing is
downloaded; ``BROWSER`` below says which), runs all cells from the Run menu, waits for the ``tokens T`` slider,
presses ArrowRight on its handle and waits until the output it drives (the text and figure of the slider's cell,
the slider itself left out) changes: the slider's readout moves, the text changes (and names the new ``T`` when it
prints ``T = <n>``), and every figure is redrawn, neither blank nor half drawn (it keeps at least half of the
non-white pixels it had). The screenshot lands in ``build/test/browser-05.png``.

Why the figure check: JupyterLab 4.6 with ipykernel 7 handles some widget messages on a kernel subshell thread,
and every comm message ends with IPython's ``post_execute`` hooks, matplotlib-inline's ``flush_figures``
among them. A callback that draws with pyplot (``plt.subplots`` ... ``plt.show()``) can then be rendered by
that other thread halfway through: the page shows a white or half-drawn PNG. A callback that draws on its own
``matplotlib.figure.Figure`` and ``display(fig)``s it is safe.

The browser, in this order:

- ``chromium``: ``MOELAB_CHROMIUM`` (a Chromium or Chrome binary), else Debian's ``chromium`` (or Ubuntu's
  ``chromium-browser``) on PATH, which ``make browser-deps`` installs with apt as root. Playwright launches it.
- ``qtwebengine``: Qt WebEngine, the Chromium inside PyQt6-WebEngine's wheels on PyPI, which ``make browser-deps``
  installs into the venv (the ``browser-qt`` extra) for a user without root. A small Qt program shows one page
  offscreen (``QT_QPA_PLATFORM=offscreen``) with Chromium's DevTools port open, and Playwright drives it over CDP
  through ``_CdpRelay``: Qt WebEngine has one browser context and cannot make another, so the test uses that
  context, and the relay answers the one connect-time command Qt refuses (``Browser.setDownloadBehavior``,
  "Browser context management is not supported") with an empty result. Every other command goes through as is.

``MOELAB_BROWSER=chromium|qtwebengine`` picks one. The test makes the same checks on either. A missing browser,
Playwright or JupyterLab fails the test (the ``browser`` extra installs JupyterLab and Playwright); it never
skips. Every wait is bounded and the whole test runs under ``TEST_BUDGET_S``; the server (with its kernel) and
the browser always end in the fixtures' teardown. The browser may reach only 127.0.0.1: any other request is
aborted and reported, and the guard must have seen the page's requests.

``MOELAB_BROWSER_NOTEBOOK=<path>`` points the test at another notebook of the same shape (for development).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote, urlsplit

import pytest

pytestmark = pytest.mark.browser

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_GLOB = "05-*.ipynb"
SCREENSHOT = REPO_ROOT / "build" / "test" / "browser-05.png"

#: A Chromium binary: ``MOELAB_CHROMIUM`` (a Chromium or Chrome binary), else Debian's ``chromium`` (or Ubuntu's
#: ``chromium-browser``) on PATH, which ``make browser-deps`` installs as root.
CHROMIUM = (os.environ.get("MOELAB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
            or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 1000}


def _has_chromium() -> bool:
    return Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)


def _pick_browser() -> str:
    """``MOELAB_BROWSER`` if set, else ``chromium`` when there is a binary, else ``qtwebengine``."""
    forced = os.environ.get("MOELAB_BROWSER", "")
    if forced:
        assert forced in ("chromium", "qtwebengine"), f"MOELAB_BROWSER={forced!r}: expected chromium or qtwebengine"
        return forced
    return "chromium" if _has_chromium() else "qtwebengine"


#: The browser this run drives (see the module docstring).
BROWSER = _pick_browser()

#: The slider's ``description`` in notebook 05 (an ipywidgets IntSlider), matched as a substring.
SLIDER_DESCRIPTION = "tokens T"
#: The parameters injected into the copy (the notebook's own ``parameters`` cell declares both).
PARAMETERS = {"INTERACTIVE": True, "SMOKE": True}
#: A figure with less than this share of non-white pixels is blank (a white PNG: nothing was drawn).
MIN_INK = 0.005
#: After one step of the slider, each figure keeps at least this share of the ink it had before.
INK_KEPT = 0.5

TEST_BUDGET_S = 170.0  # the whole test, server start to teardown, stays under 3 minutes
SERVER_START_S = 60.0
PAGE_LOAD_S = 60.0
KERNEL_IDLE_S = 60.0
RUN_ALL_S = 90.0
SLIDER_CHANGE_S = 45.0


class Deadline:
    """One budget for the whole test: every wait takes ``min(its own cap, what is left)``."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, cap: float) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            pytest.fail(f"browser test: over its {TEST_BUDGET_S:.0f} s budget")
        return min(cap, left)

    def ms(self, cap: float) -> float:
        return 1000.0 * self.left(cap)


# ----------------------------------------------------------------------------------------------- the notebook


def _find_notebook() -> Path:
    override = os.environ.get("MOELAB_BROWSER_NOTEBOOK")
    if override:
        path = Path(override)
        assert path.is_file(), f"MOELAB_BROWSER_NOTEBOOK={override}: no such notebook"
        return path
    found = sorted((REPO_ROOT / "notebooks").glob(NOTEBOOK_GLOB))
    assert found, f"no notebooks/{NOTEBOOK_GLOB}: the browser test drives notebook 05's slider"
    assert len(found) == 1, f"more than one notebooks/{NOTEBOOK_GLOB}: {[p.name for p in found]}"
    return found[0]


def _interactive_copy(src: Path, dest_dir: Path) -> Path:
    """``src`` with ``PARAMETERS`` injected after its ``parameters`` cell (papermill's way), into ``dest_dir``."""
    import nbformat
    from papermill.parameterize import parameterize_notebook

    nb = nbformat.read(src, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{src.name}: expected one cell tagged 'parameters', found {len(tagged)}"
    for name in PARAMETERS:
        assert re.search(rf"^{name}\s*=", tagged[0].source, re.M), f"{src.name}: parameters cell lacks {name}"
    assert nb.metadata.get("kernelspec", {}).get("name"), f"{src.name}: no kernelspec in its metadata"
    params = dict(PARAMETERS)
    if re.search(r"^OUT_DIR\s*=", tagged[0].source, re.M):
        params["OUT_DIR"] = str(dest_dir / "figures")  # figures it saves stay out of the repository
    for c in nb.cells:  # papermill's own run adds these before it parameterizes
        c.metadata.setdefault("tags", [])
    nb.metadata.setdefault("papermill", {})
    nb = parameterize_notebook(nb, params)
    dest = dest_dir / src.name
    nbformat.write(nb, dest)
    return dest


# -------------------------------------------------------------------------------------------- the lab server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        with opener.open(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


class LabServer:
    def __init__(self, proc: subprocess.Popen, port: int, token: str, log: Path):
        self.proc, self.port, self.token, self.log = proc, port, token, log

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{quote(notebook)}?token={self.token}"


@pytest.fixture
def deadline():
    return Deadline(TEST_BUDGET_S)


@pytest.fixture
def lab_root(tmp_path):
    root = tmp_path / "lab"
    root.mkdir()
    return root


@pytest.fixture
def lab_server(tmp_path, lab_root, deadline):
    """JupyterLab on 127.0.0.1:<free port> with a random token, its config, data and settings in tmp_path."""
    token = secrets.token_hex(24)
    port = _free_port()
    home = tmp_path / "jupyter"
    user_settings = {
        # No news feed, no update check: nothing asks the network, no toast covers the notebook.
        "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        # Every cell in the DOM (no windowing), so every prompt and output can be read.
        "notebook-extension/tracker": {"windowingMode": "none"},
    }
    for name, values in user_settings.items():
        path = home / "user-settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # the kernel uses the inline backend, so figures reach the page
    env.update(
        JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
        NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
    )
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
        "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={lab_root}",
        f"--LabApp.user_settings_dir={home / 'user-settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",  # the 'pypi' manager would ask PyPI
        "--ServerApp.allow_root=True",  # CI runs as root
    ]
    log = tmp_path / "jupyterlab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=lab_root,
                                start_new_session=True)
    try:
        status = f"http://127.0.0.1:{port}/api/status?token={token}"
        end = time.monotonic() + deadline.left(SERVER_START_S)
        while not _answers(status):
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{_log_tail(log)}")
            if time.monotonic() > end:
                pytest.fail(f"jupyter lab did not answer on port {port} in {SERVER_START_S:.0f} s:\n{_log_tail(log)}")
            time.sleep(0.25)
        yield LabServer(proc, port, token, log)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server shuts its kernels down), then SIGKILL to the server's own process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started: the server and its kernel
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


# ----------------------------------------------------------------------------------------------- the browser


def _require_browser() -> None:
    """The browser, Playwright and JupyterLab are there, or the test fails (it never skips)."""
    if BROWSER == "chromium" and not _has_chromium():
        pytest.fail(f"MOELAB_BROWSER=chromium but {CHROMIUM} is missing: install Debian's chromium (apt-get install "
                    "-y chromium) or set MOELAB_CHROMIUM=/path/to/chromium; the test never downloads a browser")
    if BROWSER == "qtwebengine":
        try:
            import PyQt6.QtWebEngineWidgets  # noqa: F401
        except ImportError as e:  # not installed, or a system library it links is missing (the message names it)
            pytest.fail(f"no browser: no Chromium ({CHROMIUM} is missing; set MOELAB_CHROMIUM, or install Debian's "
                        "chromium) and Qt WebEngine does not load (`make browser-deps` installs PyQt6-WebEngine into "
                        f".venv: pip install -e '.[browser-qt]'): {e}")
    for module, what in (("playwright.sync_api", "playwright"), ("jupyterlab", "jupyterlab")):
        try:
            __import__(module)
        except ImportError as e:
            pytest.fail(f"{what} (Python) is missing: pip install -e '.[browser]' ({e})")


#: The Qt program: one page, offscreen, with Chromium's DevTools port open; it quits by itself after argv[1] s.
_QT_BROWSER = """
import sys
from PyQt6.QtCore import QTimer, QUrl
from PyQt6.QtWebEngineWidgets import QWebEngineView
from PyQt6.QtWidgets import QApplication

app = QApplication(sys.argv[:1])
view = QWebEngineView()
view.resize(int(sys.argv[2]), int(sys.argv[3]))
view.load(QUrl("about:blank"))
view.show()
QTimer.singleShot(int(float(sys.argv[1]) * 1000), app.quit)
sys.exit(app.exec())
"""


@contextlib.contextmanager
def _qt_webengine(tmp_path: Path, deadline: Deadline):
    """Start the Qt program; yield its browser's DevTools websocket URL; always stop it."""
    port = _free_port()
    home = tmp_path / "qt"
    env = dict(os.environ)
    env.update(
        QT_QPA_PLATFORM="offscreen", QTWEBENGINE_REMOTE_DEBUGGING=f"127.0.0.1:{port}",
        QTWEBENGINE_DISABLE_SANDBOX="1", QTWEBENGINE_CHROMIUM_FLAGS=" ".join(CHROMIUM_ARGS[1:]),
        XDG_CONFIG_HOME=str(home / "config"), XDG_CACHE_HOME=str(home / "cache"),
        XDG_DATA_HOME=str(home / "data"), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
    )
    log = tmp_path / "qtwebengine.log"
    cmd = [sys.executable, "-c", _QT_BROWSER, str(TEST_BUDGET_S + 30), str(VIEWPORT["width"]),
           str(VIEWPORT["height"])]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        end = time.monotonic() + deadline.left(30)
        while True:
            try:
                with opener.open(f"http://127.0.0.1:{port}/json/version", timeout=2) as r:
                    yield json.load(r)["webSocketDebuggerUrl"]
                    return
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None:
                    pytest.fail(f"the Qt WebEngine browser exited with {proc.returncode}:\n{_log_tail(log)}")
                if time.monotonic() > end:
                    pytest.fail(f"Qt WebEngine's DevTools port {port} did not answer in 30 s:\n{_log_tail(log)}")
                time.sleep(0.25)
    finally:
        _stop(proc)


class _CdpRelay:
    """A websocket relay from Playwright to a browser's DevTools endpoint, on 127.0.0.1, in a thread.

    It passes every message as is, except the error of a command named in ``EMPTY_RESULT``, which it turns into an
    empty result. Qt WebEngine refuses ``Browser.setDownloadBehavior`` (it has no context management), which
    Playwright sends while it connects; the test downloads nothing.
    """

    EMPTY_RESULT = frozenset({"Browser.setDownloadBehavior"})

    def __init__(self, upstream: str):
        import asyncio
        import threading

        import tornado.web
        import tornado.websocket

        relay = self

        class Handler(tornado.websocket.WebSocketHandler):
            async def open(self, *args):
                self.sent: dict[tuple, str] = {}
                self.up = await tornado.websocket.websocket_connect(upstream, max_message_size=1 << 30)
                asyncio.ensure_future(self.pump())

            async def pump(self):
                while (msg := await self.up.read_message()) is not None:
                    m = json.loads(msg)
                    if "error" in m and self.sent.pop((m.get("sessionId"), m.get("id")), "") in relay.EMPTY_RESULT:
                        relay.emptied += 1
                        msg = json.dumps({k: v for k, v in m.items() if k != "error"} | {"result": {}})
                    await self.write_message(msg)
                self.close()

            def on_message(self, msg):
                m = json.loads(msg)
                self.sent[(m.get("sessionId"), m.get("id"))] = m.get("method", "")
                return self.up.write_message(msg)

            def on_close(self):
                if getattr(self, "up", None) is not None:
                    self.up.close()

        self.emptied = 0
        self.port = _free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            app = tornado.web.Application([(r"/.*", Handler)], websocket_max_message_size=1 << 30)
            self.server = app.listen(self.port, "127.0.0.1")
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, name="cdp-relay", daemon=True)
        self.thread.start()
        assert started.wait(10), "the CDP relay did not start"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/devtools/browser"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.fixture
def browser_page(tmp_path, deadline):
    """A Playwright page in ``BROWSER``, with only 127.0.0.1 reachable; always closed."""
    _require_browser()
    from playwright.sync_api import sync_playwright

    blocked: list[str] = []
    routed: list[str] = []

    def loopback_only(route):
        routed.append(route.request.url)
        host = urlsplit(route.request.url).hostname
        if host in ("127.0.0.1", "localhost") or route.request.url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    with sync_playwright() as pw, contextlib.ExitStack() as stack:
        if BROWSER == "chromium":
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
                                         timeout=deadline.ms(30))
            stack.callback(browser.close)
            context = browser.new_context(viewport=VIEWPORT)
            context.route("**/*", loopback_only)
            page = context.new_page()
        else:
            relay = _CdpRelay(stack.enter_context(_qt_webengine(tmp_path, deadline)))
            stack.callback(relay.close)
            browser = pw.chromium.connect_over_cdp(relay.url, timeout=deadline.ms(30))
            stack.callback(browser.close)
            context = browser.contexts[0]  # Qt WebEngine's one context, with its one page
            context.route("**/*", loopback_only)
            page = context.pages[0]
            page.set_viewport_size(VIEWPORT)
        page.blocked_requests = blocked  # read by the test, for its report
        page.routed_requests = routed  # the guard saw the page's requests (else it guards nothing)
        yield page


# -------------------------------------------------------------------------------------------------- the page

#: The driven output of the slider's cell: its output area with every slider (the readout included) left out,
#: as text plus the sources of its images (inline matplotlib figures are <img src="data:image/png;base64,...">).
_DRIVEN_JS = """
(cell) => {
  const area = cell.querySelector('.jp-Cell-outputWrapper') || cell;
  const clone = area.cloneNode(true);
  clone.querySelectorAll('.widget-slider, .jupyter-widget-slider, .widget-readout').forEach(e => e.remove());
  const imgs = Array.from(clone.querySelectorAll('img')).map(i => i.getAttribute('src') || '');
  const canvases = Array.from(area.querySelectorAll('canvas')).map(c => {
    try { return c.toDataURL(); } catch (e) { return ''; } });
  return {text: (clone.innerText || clone.textContent || '').trim(), imgs: imgs.concat(canvases)};
}
"""

#: Put the slider near the top of the notebook's scrolling area (a little room above it).
_SCROLL_TO_TOP_JS = """
(e) => {
  e.scrollIntoView({block: 'start'});
  for (let p = e.parentElement; p; p = p.parentElement) {
    if (p.scrollHeight > p.clientHeight && getComputedStyle(p).overflowY !== 'visible') { p.scrollBy(0, -48); break; }
  }
}
"""

_TRACEBACK = "Traceback (most recent call last)"


class Driven(NamedTuple):
    """What the slider drives, as read off the page: the text, and per image a digest and its share of ink."""

    text: str
    digests: tuple[str, ...]
    ink: tuple[float, ...]

    def same(self, other: Driven) -> bool:
        return (self.text, self.digests) == (other.text, other.digests)


def _ink(src: str) -> float:
    """Share of an image's pixels that are not background (near-white or transparent); 1.0 if not a data: PNG."""
    if not src.startswith("data:image/png;base64,"):
        return 1.0
    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGBA")
    white = Image.new("RGBA", img.size, (255, 255, 255, 255))
    gray = Image.alpha_composite(white, img).convert("L")
    hist = gray.histogram()
    return 1.0 - sum(hist[250:]) / max(1, gray.width * gray.height)


def _driven(cell) -> Driven:
    sig = cell.evaluate(_DRIVEN_JS)
    return Driven(sig["text"], tuple(hashlib.sha256(s.encode()).hexdigest()[:16] for s in sig["imgs"]),
                  tuple(_ink(s) for s in sig["imgs"]))


def _all_outputs_text(page) -> str:
    return "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())


_KERNEL_STATE_JS = """
() => {
  const dialog = document.querySelector('.jp-Dialog');
  if (dialog) return {dialog: dialog.innerText.trim()};
  const name = document.querySelector('.jp-NotebookPanel-toolbar .jp-KernelName');
  const status = document.querySelector('.jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator');
  return {name: name ? name.innerText.trim() : '', status: status ? status.getAttribute('data-status') : ''};
}
"""


def _wait_kernel_idle(page, timeout_s: float, *, hold_s: float = 1.0) -> str:
    """The notebook's kernel is started, connected and idle, and stays so for ``hold_s``; its display name.

    JupyterLab 4's execution indicator reads ``idle`` before any kernel exists (the toolbar's kernel name then
    reads "No Kernel"), so both must agree, for a while. A dialog (Select Kernel: the notebook has no
    kernelspec; a kernel error) fails the test with its text.
    """
    end, since, state = time.monotonic() + timeout_s, None, {}
    while time.monotonic() < end:
        state = page.evaluate(_KERNEL_STATE_JS)
        if "dialog" in state:
            pytest.fail(f"JupyterLab opened a dialog instead of the kernel (does the notebook carry a kernelspec?):"
                        f"\n{state['dialog'][:1000]}")
        ready = state["status"] == "idle" and state["name"] not in ("", "No Kernel", "Kernel")
        if ready and since is None:
            since = time.monotonic()
        elif not ready:
            since = None
        if since is not None and time.monotonic() - since >= hold_s:
            return state["name"]
        time.sleep(0.2)
    pytest.fail(f"the notebook's kernel was not idle within {timeout_s:.0f} s (last seen: {state})")


def _wait_all_cells_done(page, n_cells: int, timeout_ms: float) -> None:
    """Every code cell has an execution count and none is queued or running ([*])."""
    page.wait_for_function(
        """(n) => {
             const prompts = Array.from(document.querySelectorAll(
               '.jp-NotebookPanel .jp-CodeCell .jp-InputArea-prompt')).map(p => p.textContent.trim());
             return prompts.length >= n && prompts.every(t => /^\\[\\d+\\]:?$/.test(t));
           }""",
        arg=n_cells, timeout=timeout_ms, polling=250)


def _run_all_cells(page, timeout_ms: float) -> None:
    """Run > Run All Cells, from JupyterLab's menu bar."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click(timeout=timeout_ms)
    page.locator(".lm-Menu-item:not(.lm-mod-disabled)", has_text=re.compile(r"^Run All Cells")).first.click(
        timeout=timeout_ms)


def test_notebook_05_slider_drives_output_in_chromium(request, lab_root, deadline):
    import nbformat

    _require_browser()  # here, so a missing browser is a failure of this test, before any server starts
    notebook = _interactive_copy(_find_notebook(), lab_root)
    n_code = sum(c.cell_type == "code" for c in nbformat.read(notebook, as_version=4).cells)
    lab_server = request.getfixturevalue("lab_server")
    page = request.getfixturevalue("browser_page")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    try:
        page.goto(lab_server.url(notebook.name), wait_until="domcontentloaded", timeout=deadline.ms(PAGE_LOAD_S))
        page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=deadline.ms(PAGE_LOAD_S))
        kernel = _wait_kernel_idle(page, deadline.left(KERNEL_IDLE_S))
        t_ready = time.monotonic()

        _run_all_cells(page, deadline.ms(10))
        panel = page.locator(".jp-NotebookPanel")
        any_slider = page.locator(".widget-slider", has=page.locator(".widget-label", has_text=SLIDER_DESCRIPTION))
        slider = panel.locator(any_slider)
        try:
            _wait_all_cells_done(page, n_code, deadline.ms(RUN_ALL_S))
            slider.first.wait_for(state="visible", timeout=deadline.ms(20))
        except Exception as e:  # report what the notebook printed (a traceback, most likely)
            pytest.fail(f"no '{SLIDER_DESCRIPTION}' slider after Run All ({type(e).__name__}); outputs:\n"
                        f"{_all_outputs_text(page)[-4000:]}")
        outputs = _all_outputs_text(page)
        assert _TRACEBACK not in outputs, f"a cell raised under INTERACTIVE=True:\n{outputs[-4000:]}"
        assert slider.count() == 1, f"expected one '{SLIDER_DESCRIPTION}' slider, found {slider.count()}"
        _wait_kernel_idle(page, deadline.left(KERNEL_IDLE_S))
        t_ran = time.monotonic()

        cell = panel.locator(".jp-Cell", has=any_slider)
        slider.scroll_into_view_if_needed(timeout=deadline.ms(10))
        readout = slider.locator(".widget-readout")
        # The driven output is there before we move anything: the first render, text and/or figure.
        page.wait_for_function(f"(cell) => ({_DRIVEN_JS})(cell).text.length + ({_DRIVEN_JS})(cell).imgs.length > 0",
                               arg=cell.element_handle(), timeout=deadline.ms(30), polling=250)
        value_before = readout.inner_text().strip()
        before = _driven(cell)

        handle = slider.locator(".noUi-handle").first
        handle.focus(timeout=deadline.ms(10))
        handle.press("ArrowRight", timeout=deadline.ms(10))
        # The readout follows the handle at once; the driven output changes once the kernel has re-run.
        end = time.monotonic() + deadline.left(SLIDER_CHANGE_S)
        after, stable_since = before, None
        while time.monotonic() < end:
            now = _driven(cell)
            complete = (bool(now.text) or not before.text) and len(now.digests) >= len(before.digests)
            if not now.same(before) and complete:
                if now.same(after) and stable_since and time.monotonic() - stable_since > 0.75:
                    break
                if not now.same(after):
                    after, stable_since = now, time.monotonic()
            time.sleep(0.2)
        value_after = readout.inner_text().strip()
        t_moved = time.monotonic()
        slider.evaluate(_SCROLL_TO_TOP_JS)  # the screenshot shows the slider and, below it, the output it drives
    finally:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(SCREENSHOT), timeout=10_000)

    assert value_after != value_before, f"ArrowRight did not move the slider (readout {value_before!r})"
    moved = f"when the slider went {value_before} -> {value_after}"
    assert not after.same(before), (f"the output driven by '{SLIDER_DESCRIPTION}' did not change {moved} "
                                    f"(text: {before.text[-500:]!r})")
    assert all(ink >= MIN_INK for ink in before.ink), f"a figure drawn before the slider moved is blank: {before.ink}"
    if before.digests:
        assert after.digests != before.digests, f"the figure did not change {moved}"
        # One step of the slider barely changes how much is drawn; a figure with far less ink than before is
        # blank or half drawn (seen: a white PNG, and one with axes and legend but no bars).
        floor = [max(MIN_INK, INK_KEPT * ink) for ink in before.ink]
        assert len(after.ink) == len(floor) and all(a >= f for a, f in zip(after.ink, floor)), (
            f"the figure redrawn {moved} is blank or half drawn (share of non-white pixels per image: "
            f"{[round(i, 4) for i in after.ink]}, before: {[round(i, 4) for i in before.ink]}); see {SCREENSHOT}")
    m = re.search(r"\bT\s*=\s*(\d+)", after.text)
    if m and value_after.isdigit():
        assert m.group(1) == value_after, f"the output says T = {m.group(1)} but the slider reads {value_after}"
    assert page.routed_requests, "the loopback-only guard saw no request: it guards nothing in this browser"
    print(f"browser-05 ({BROWSER}): page+kernel ({kernel}) {t_ready - t0:.1f} s, run all {t_ran - t_ready:.1f} s, "
          f"slider {value_before} -> {value_after} in {t_moved - t_ran:.1f} s; text now {after.text[:120]!r}; "
          f"{len(after.digests)} figure(s), ink {[round(i, 3) for i in after.ink]}; "
          f"blocked non-loopback requests: {page.blocked_requests[:5]}; screenshot {SCREENSHOT}")
