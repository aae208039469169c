"""Open the built site in headless Chromium and measure what a reader would see.

Used by tests/test_browser.py; also runnable by hand, to look at the screenshots:

    .venv/bin/python tests/browser.py [SITE_DIR]     # builds the site when no SITE_DIR is given

Chromium is the system one (Debian: ``apt-get install chromium``), driven by Playwright
(``pip install playwright``; never ``playwright install``: no browser is downloaded).
Set MINIDDP_CHROMIUM to use another binary.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

WIDE = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
MIN_MERMAID_SCALE = 0.6       # rendered width / natural (viewBox) width
MIN_DARK_LUMINANCE = 0.4      # sequence-diagram arrows on the slate (dark) palette
# Screenshots show the first screen of each page; MINIDDP_FULL_SCREENSHOTS=1 takes whole pages (slower).
FULL_PAGE_SHOTS = os.environ.get("MINIDDP_FULL_SCREENSHOTS") == "1"


def find_chromium() -> str | None:
    """The Chromium binary to drive, or None."""
    explicit = os.environ.get("MINIDDP_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).exists() else None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def build_site(site_dir: Path) -> None:
    """``mkdocs build --strict`` into site_dir; raises with mkdocs' output on failure."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output readable
        pass


class SiteServer:
    """Serve a built site on 127.0.0.1 (a free port) from a background thread."""

    def __init__(self, site_dir: Path):
        handler = functools.partial(_QuietHandler, directory=str(site_dir))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "SiteServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def site_pages(site_dir: Path) -> list[str]:
    """Every page of the built site, as a path relative to the root ("" for the home page)."""
    pages = []
    for index in sorted(site_dir.rglob("index.html")):
        rel = index.parent.relative_to(site_dir).as_posix()
        if rel.startswith(("assets", "search")):
            continue
        pages.append("" if rel == "." else rel + "/")
    return pages


# Material puts every diagram in a *closed* shadow root. The test opens them (before any
# page script runs) so it can measure the SVG; the site itself is not changed.
INIT_SCRIPT = """
(() => {
  const attach = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) {
    return attach.call(this, Object.assign({}, init, {mode: "open"}));
  };
})();
"""

# Material's search worker builds the lunr index of the whole site on every full page load: most of a
# page's CPU here. The index is one for every page, so it is built and queried once, in its own context
# (phase 2); on every other load this inert stand-in takes the worker's place, and the search box waits.
NO_SEARCH_WORKER_SCRIPT = r"""
(() => {
  const Real = window.Worker;
  class Inert extends EventTarget { postMessage() {} terminate() {} }
  window.Worker = function (url, options) {
    return /workers\/search/.test(String(url)) ? new Inert() : new Real(url, options);
  };
})();
"""

# Resolves when no diagram is waiting to be rendered (or after `ms`).
WAIT_FOR_MERMAID_JS = """
async (ms) => {
  const t0 = performance.now();
  while (performance.now() - t0 < ms) {
    const waiting = document.querySelectorAll("pre.mermaid").length;
    const hosts = [...document.querySelectorAll("div.mermaid")];
    if (!waiting && hosts.every(h => h.shadowRoot && h.shadowRoot.querySelector("svg"))) return true;
    await new Promise(r => setTimeout(r, 50));
  }
  return false;
}
"""

MEASURE_JS = """
() => {
  const visible = el => el.getClientRects().length > 0 && getComputedStyle(el).visibility !== "hidden";
  const label = el => (el.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 60);
  const out = {mermaid: [], code: [], copy: [], images: [], pageOverflow: 0};

  document.querySelectorAll("pre.mermaid").forEach(
    (el, i) => out.mermaid.push({index: i, rendered: false, label: label(el)}));
  document.querySelectorAll("div.mermaid").forEach((host, i) => {
    const svg = host.shadowRoot && host.shadowRoot.querySelector("svg");
    if (!svg) { out.mermaid.push({index: i, rendered: false, label: label(host)}); return; }
    const vb = svg.viewBox && svg.viewBox.baseVal;
    const natural = vb && vb.width ? vb.width : svg.getBBox().width;
    const width = svg.getBoundingClientRect().width;
    const text = svg.textContent || "";
    out.mermaid.push({index: i, rendered: true, error: /Syntax error|Parse error/i.test(text),
                      natural: Math.round(natural), width: Math.round(width), scale: width / natural,
                      label: text.trim().replace(/\\s+/g, " ").slice(0, 60)});
  });

  document.querySelectorAll("pre > code").forEach((code, i) => {
    if (!visible(code) || code.closest(".mermaid")) return;
    const over = code.scrollWidth - code.clientWidth;
    if (over > 1) out.code.push({index: i, overflow: over, label: label(code)});
    // the copy button must not sit on any glyph of the block
    const pre = code.parentElement;
    const button = pre.querySelector(".md-code__nav, .md-clipboard");
    if (!button || !visible(button)) return;
    const b = button.getBoundingClientRect();
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (!node.textContent.trim()) continue;
      range.selectNodeContents(node);
      const hit = [...range.getClientRects()].find(
        r => r.width > 0 && r.left < b.right && r.right > b.left && r.top < b.bottom && r.bottom > b.top);
      if (hit) { out.copy.push({index: i, label: label(code)}); break; }
      const last = range.getBoundingClientRect();
      if (last.top > b.bottom) break;
    }
  });

  document.querySelectorAll("img").forEach(img => {
    if (!(img.complete && img.naturalWidth > 0)) out.images.push(img.getAttribute("src"));
  });
  out.pageOverflow = document.documentElement.scrollWidth - window.innerWidth;
  out.tables = document.querySelectorAll("article table, .md-content table").length;
  out.sequence = document.querySelectorAll("div.mermaid").length && [...document.querySelectorAll("div.mermaid")].some(
    h => h.shadowRoot && h.shadowRoot.querySelector("svg[aria-roledescription=sequence]"));
  return out;
}
"""

# A table is usable when it fits, or sits in a horizontally scrollable box that fits the screen.
TABLES_JS = """
() => {
  const bad = [];
  const vw = document.documentElement.clientWidth;
  document.querySelectorAll("article table, .md-content table").forEach((table, i) => {
    if (!table.getClientRects().length) return;
    const r = table.getBoundingClientRect();
    if (r.left >= -1 && r.right <= vw + 1) return;                       // fits the screen
    for (let el = table.parentElement; el && el !== document.body; el = el.parentElement) {
      const ox = getComputedStyle(el).overflowX;
      if (ox === "auto" || ox === "scroll") {
        const box = el.getBoundingClientRect();
        if (box.left >= -1 && box.right <= vw + 1 && el.scrollWidth >= table.scrollWidth - 1) return;  // scrolls
        break;
      }
    }
    bad.push({index: i, right: Math.round(r.right), viewport: vw,
              header: (table.querySelector("tr") || table).textContent.trim().replace(/\\s+/g, " ").slice(0, 60)});
  });
  return {tables: bad, pageOverflow: document.documentElement.scrollWidth - window.innerWidth};
}
"""

# Colours of sequence-diagram arrows (marker paths, message lines) against the page background.
ARROWS_JS = """
() => {
  const parse = c => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
                       const v = m[1].split(/[ ,\\/]+/).filter(Boolean).map(Number);
                       return [v[0], v[1], v[2], v.length > 3 ? v[3] : 1]; };
  const lum = ([r, g, b]) => {
    const f = x => { x /= 255; return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; };
                               return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
  const bg = parse(getComputedStyle(document.body).backgroundColor) || [255, 255, 255, 1];
  const over = c => [0, 1, 2].map(k => c[k] * c[3] + bg[k] * (1 - c[3]));
  const out = {scheme: document.body.getAttribute("data-md-color-scheme"), background: lum(bg), arrows: []};
  document.querySelectorAll("div.mermaid").forEach((host, i) => {
    const svg = host.shadowRoot && host.shadowRoot.querySelector("svg");
    if (!svg) return;
    let worst = null;
    const consider = (el, prop, what) => {
      const c = parse(getComputedStyle(el)[prop]); if (!c || c[3] === 0) return;
      const l = lum(over(c));
      if (!worst || l < worst.luminance) worst = {luminance: l, what: what + " " + prop};
    };
    // the arrowheads drawn (markers some line refers to), and the lines of a sequence diagram
    const used = new Set();
    svg.querySelectorAll("[marker-end], [marker-start]").forEach(el => ["marker-end", "marker-start"].forEach(a => {
      const m = /url\\(#([^)]+)\\)/.exec(el.getAttribute(a) || ""); if (m) used.add(m[1]); }));
    svg.querySelectorAll("marker").forEach(m => { if (!used.has(m.id)) return;
      m.querySelectorAll("path").forEach(
        p => consider(p, getComputedStyle(p).fill === "none" ? "stroke" : "fill", "#" + m.id)); });
    svg.querySelectorAll(".messageLine0, .messageLine1").forEach(p => consider(p, "stroke", "message line"));
    out.arrows.push({index: i, kind: svg.getAttribute("aria-roledescription"), worst});
  });
  return out;
}
"""


@dataclass
class Report:
    """Everything the browser saw; `problems` is what the test asserts to be empty."""
    problems: list[str] = field(default_factory=list)
    pages: dict[str, dict] = field(default_factory=dict)
    screenshots: Path | None = None
    seconds: float = 0.0

    def add(self, page: str, message: str) -> None:
        self.problems.append(f"/{page}: {message}")

    def summary(self) -> str:
        lines = []
        for page, info in self.pages.items():
            scales = [m["scale"] for m in info.get("mermaid", []) if m.get("rendered")]
            lines.append(f"  /{page:<28} code overflowing: {len(info.get('code', []))}"
                         f"  smallest diagram scale: {min(scales):.2f}" if scales else
                         f"  /{page:<28} code overflowing: {len(info.get('code', []))}")
        return "\n".join(lines)


def _is_local(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("data", "blob", "about") or parts.hostname == "127.0.0.1"


def check_site(site_dir: Path, chromium: str, shots: Path, search_term: str = "Sharding",
               search_target: str = "sharding/", dark_pages: tuple[str, ...] | None = None,
               every_shot: bool = True) -> Report:
    """Open every page of site_dir; return a Report whose problems list every failure. Screenshots of every
    page, or (``every_shot=False``, the test's choice: encoding them is a tenth of the browser's time) of the
    pages with a problem only."""
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    report = Report(screenshots=shots)
    shots.mkdir(parents=True, exist_ok=True)
    pages = site_pages(site_dir)
    with SiteServer(site_dir) as server, sync_playwright() as pw:
        # Requests to any other host fail at once, without leaving the machine (requests are
        # recorded from the page's events; a route handler would disable the HTTP cache).
        browser = pw.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
        try:
            def new_context(search: bool = False, **settings):
                made = browser.new_context(**{"viewport": WIDE, "device_scale_factor": 1, **settings})
                made.add_init_script(INIT_SCRIPT)
                if not search:
                    made.add_init_script(NO_SEARCH_WORKER_SCRIPT)
                return made

            context = new_context()
            external: list[tuple[str, str]] = []
            current = {"page": ""}

            page = context.new_page()
            page.on("request", lambda r: _is_local(r.url) or external.append((current["page"], r.url)))
            errors: list[str] = []
            page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))

            def visit(path: str, shot: str | None) -> dict:
                """Load and measure ``path``; the screenshot ``shot`` is taken by ``shoot`` once it is judged."""
                current["page"] = path
                errors.clear()
                n_external = len(external)
                page.goto(server.url + path, wait_until="load")
                if not page.evaluate(WAIT_FOR_MERMAID_JS, 15000):
                    report.add(path, "mermaid diagrams still rendering after 15 s")
                page.evaluate("document.fonts.ready")
                info = page.evaluate(MEASURE_JS)
                for url in [u for _, u in external[n_external:]]:
                    report.add(path, f"request to another host: {url}")
                for e in errors:
                    report.add(path, e)
                return info

            def shoot(view, shot: str, problems_before: int) -> None:
                if every_shot or len(report.problems) > problems_before:
                    view.screenshot(path=str(shots / shot), full_page=FULL_PAGE_SHOTS)

            # 1. every page at 1280 px, light palette
            for path in pages:
                before = len(report.problems)
                info = visit(path, None)
                report.pages[path] = info
                for m in info["mermaid"]:
                    if not m["rendered"]:
                        report.add(path, f"diagram {m['index']} not rendered ({m['label']!r})")
                    elif m["error"]:
                        report.add(path, f"diagram {m['index']} shows a syntax error")
                    elif m["scale"] < MIN_MERMAID_SCALE:
                        report.add(path, f"diagram {m['index']} shrunk to {m['scale']:.2f} of its size "
                                         f"({m['width']} of {m['natural']} px: {m['label']!r})")
                for c in info["code"]:
                    report.add(path, f"code block {c['index']} scrolls by {c['overflow']} px ({c['label']!r})")
                for c in info["copy"]:
                    report.add(path, f"copy button covers the text of code block {c['index']} ({c['label']!r})")
                for src in info["images"]:
                    report.add(path, f"image not loaded: {src}")
                if info["pageOverflow"] > 1:
                    report.add(path, f"page scrolls sideways by {info['pageOverflow']} px at {WIDE['width']} px")
                shoot(page, (path.strip("/").replace("/", "__") or "index") + ".png", before)

            # 2. search: Material's lunr index, typed into the search box (in a context of its own: the worker)
            searching, wide = new_context(search=True), page
            page = searching.new_page()  # visit() loads and measures whatever ``page`` is
            page.on("request", lambda r: _is_local(r.url) or external.append((current["page"], r.url)))
            page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            visit("", None)
            page.click("label.md-header__button[for=__search]", timeout=5000) if page.is_visible(
                "label.md-header__button[for=__search]") else None
            box = page.locator("input.md-search__input")
            box.click()
            # the index loads in a web worker: a query typed before it is ready finds nothing (a loaded
            # machine), so wait for Material to replace its "Initializing search" first
            page.wait_for_function("() => !/initializ/i.test(document.querySelector('.md-search-result__meta')"
                                   "?.textContent ?? 'initializing')", timeout=120000)
            box.press_sequentially(search_term)  # key by key: Material queries on key events, not on a set value
            try:
                page.wait_for_selector(f".md-search-result__item a[href*='{search_target}']", timeout=30000)
            except Exception:
                hits = page.eval_on_selector_all(".md-search-result__item a", "els => els.map(a => a.href)")
                report.add("", f"searching {search_term!r} finds no link to {search_target} (found {hits[:5]})")
            page.screenshot(path=str(shots / "search.png"))
            searching.close()
            page = wide

            # 3. dark palette: the toggle, then sequence-diagram arrows must stay visible
            visit("", None)
            toggle = page.locator("form[data-md-component=palette] label:visible").first
            toggle.click()
            page.wait_for_function("document.body.getAttribute('data-md-color-scheme') === 'slate'", timeout=5000)
            if dark_pages is None:  # the home page, and every page with a sequence diagram
                dark_pages = tuple(p for p in pages if p == "" or report.pages[p]["sequence"])
            for path in dark_pages:
                before = len(report.problems)
                visit(path, None)
                arrows = page.evaluate(ARROWS_JS)
                report.pages[path]["dark"] = arrows
                if arrows["scheme"] != "slate":
                    report.add(path, f"dark palette not applied (scheme {arrows['scheme']!r})")
                for a in arrows["arrows"]:
                    if a["worst"] and a["worst"]["luminance"] < MIN_DARK_LUMINANCE:
                        report.add(path, f"dark mode: {a['kind']} diagram {a['index']} has arrows of luminance "
                                         f"{a['worst']['luminance']:.2f} ({a['worst']['what']})")
                shoot(page, "dark__" + (path.strip("/").replace("/", "__") or "index") + ".png", before)
            context.close()

            # 4. a phone: every table fits or scrolls inside its own box
            context = new_context(viewport=PHONE, is_mobile=True, has_touch=True)
            phone = context.new_page()
            for path in [p for p in pages if report.pages[p]["tables"]]:
                before = len(report.problems)
                phone.goto(server.url + path, wait_until="load")
                result = phone.evaluate(TABLES_JS)
                report.pages[path]["phone"] = result
                for t in result["tables"]:
                    report.add(path, f"at {PHONE['width']} px table {t['index']} is cut off "
                                     f"(right edge {t['right']} px: {t['header']!r})")
                if result["tables"]:
                    shoot(phone, "phone__" + (path.strip("/").replace("/", "__") or "index") + ".png", before)
            context.close()
        finally:
            browser.close()
    report.seconds = time.monotonic() - t0
    return report


def main(argv: list[str]) -> int:
    chromium = find_chromium()
    if not chromium:
        print("no Chromium found (apt-get install chromium, or set MINIDDP_CHROMIUM)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(argv[0]) if argv else Path(tmp) / "site"
        if not argv:
            build_site(site)
        shots = Path(tempfile.mkdtemp(prefix="miniddp-screens-"))
        report = check_site(site, chromium, shots)
    print(report.summary())
    print(f"screenshots: {shots}   ({report.seconds:.0f} s in the browser)")
    print("\n".join(report.problems) or "no problems")
    if os.environ.get("MINIDDP_BROWSER_JSON"):
        Path(os.environ["MINIDDP_BROWSER_JSON"]).write_text(json.dumps(report.pages, indent=1))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
