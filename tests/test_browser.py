"""The site, opened in a real browser (headless Chromium), is readable.

One test builds the site (``mkdocs build --strict``), serves it on 127.0.0.1 and opens
every page, rendered notebooks and the API page included, at 1280x900. Per page:

* every mermaid diagram rendered (no "Syntax error") at >= 0.6 of its natural size;
* no visible code block scrolls sideways, and no copy button sits on its text;
* no request leaves 127.0.0.1 (fonts, scripts: everything is served by the site);
* every image loaded, no console error, no sideways scrolling of the page.

Then: Material's search finds the Sharding page; in the dark palette the arrows of
sequence diagrams are light (the home page and every page with one); at 390 px (a phone)
every table fits or scrolls inside its own box. All failures are reported at once.
Material's search worker rebuilds the whole site's index on every full page load (most of
a page's CPU), so it runs only where search is tested; elsewhere an inert stand-in takes its place.
Screenshots of the pages with a problem go to a temporary directory, printed at the end (``pytest -s``
shows it); MINIDDP_SCREENSHOTS=1 takes every page's, as ``python tests/browser.py`` does.

Needs Chromium (Debian: ``apt-get install chromium``) and Playwright from PyPI (in the
``test`` extra); no browser is downloaded. Skipped, with the reason, without them.
"""

import os
import tempfile
from pathlib import Path

import pytest

from browser import build_site, check_site, find_chromium

pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found: apt-get install chromium "
                                                          "(or set MINIDDP_CHROMIUM to a Chromium/Chrome binary)")


@pytest.mark.timeout(900)
def test_every_page_is_readable_in_a_browser(tmp_path):
    site = tmp_path / "site"
    build_site(site)
    shots = Path(tempfile.mkdtemp(prefix="miniddp-screenshots-"))
    report = check_site(site, CHROMIUM, shots, every_shot=os.environ.get("MINIDDP_SCREENSHOTS") == "1")
    print(report.summary())
    print(f"{len(report.pages)} pages checked in {report.seconds:.0f} s; screenshots in {shots}")
    assert report.pages, "the built site has no pages"
    assert {"", "sharding/", "api/"} <= set(report.pages), sorted(report.pages)
    assert any(p.startswith("notebooks/") for p in report.pages), "no rendered notebook in the site"
    assert not report.problems, f"{len(report.problems)} problems (screenshots in {shots}):\n" + "\n".join(
        report.problems)
