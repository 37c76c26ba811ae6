"""The page at `/` (server/http/page): what a model sees, in a real headless Chromium against the real
server with the built-in models; and, without a browser, what the page is made of.

The browser tests need Debian's chromium and chromedriver (`make sysdeps`); without them they skip,
and under CI they fail. The screenshot goes to the test's tmp_path, and to docs/images/page.png
(the README's) when that file is missing or SOFTMOE_UPDATE_SCREENSHOT=1: a run never rewrites the
committed picture by accident.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from helpers.live import live_server
from server.http.app import create_app
from server.http.routes.page import ASSETS
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
SEVEN = ROOT / "docs" / "examples" / "seven.png"
SCREENSHOT = ROOT / "docs" / "images" / "page.png"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1100")
# The public endpoints the page calls, with their methods: the only ones it may use.
ENDPOINTS = {"/v1/models": "get", "/v1/classify": "post", "/v1/zero-shot": "post", "/v1/routing": "post"}
TYPES = {".js": "text/javascript", ".css": "text/css"}


# ------------------------------------------------------------------------------- without a browser

class Refs(HTMLParser):
    """Every src/href of a document, and what CSP 'self' would refuse: inline scripts and styles."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.inline: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.refs += [attrs[k] for k in ("src", "href") if attrs.get(k)]
        if tag == "style" or "style" in attrs or any(k.startswith("on") for k in attrs):
            self.inline.append(tag)
        if tag == "script" and not attrs.get("src"):
            self.inline.append("script")


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(Settings()))  # no lifespan: the page and its files need no model


@pytest.fixture(scope="module")
def served(client) -> dict[str, str]:
    """The page's files as served: path -> text."""
    index = client.get("/")
    refs = Refs()
    refs.feed(index.text)
    return {"/": index.text, **{f"/{r}": client.get(f"/{r}").text for r in refs.refs if not r.startswith("data:")}}


def test_the_page_is_html_with_a_strict_csp(client):
    r = client.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "unsafe" not in csp, csp
    refs = Refs()
    refs.feed(r.text)
    assert not refs.inline, f"inline {refs.inline} would be refused by the page's own CSP"


def test_every_asset_is_served_with_its_type(client, served):
    assets = [path for path in served if path != "/"]
    assert sorted(p.rsplit("/", 1)[1] for p in assets) == sorted(ASSETS)  # the page names every served file
    for path in assets:
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith(TYPES[Path(path).suffix]), (path, r.headers["content-type"])
        assert "content-security-policy" in r.headers
    r = client.get("/static/index.html")  # in server/http/page, but not an asset
    assert r.status_code == 404 and "error" in r.json()


def test_the_page_references_nothing_outside_the_server(served):
    for path, text in served.items():
        assert not re.findall(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), f"{path} names another origin"


def test_the_page_calls_only_public_endpoints_that_exist(client, served):
    script = served["/static/page.js"]
    called = {"/" + p for p in re.findall(r"[\"'`]/?(v\d+/[\w/-]+)", script)}
    assert called == set(ENDPOINTS), called
    paths = client.get("/openapi.json").json()["paths"]
    for path, method in ENDPOINTS.items():
        assert method in paths.get(path, {}), f"the page calls {method.upper()} {path}: not in the OpenAPI"
    assert "/" not in paths and not any(p.startswith("/static") for p in paths)  # the page adds no API


# ---------------------------------------------------------------------------------- in Chromium

def need(name: str) -> str:
    """A browser binary from `make sysdeps`: skip without it, fail under CI (like tests/deploy's tool())."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} not found: `make sysdeps` installs Debian's chromium and chromium-driver")
        pytest.skip(f"{name} not installed (`make sysdeps` installs chromium and chromium-driver)")
    return path


@pytest.fixture(scope="module")
def url():
    with live_server(create_app(Settings())) as u:  # default settings, built-in models
        yield u


@pytest.fixture(scope="module")
def browser():
    chromium, chromedriver = need("chromium"), need("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, 20).until(condition)
    except Exception as e:  # noqa: BLE001 - name what did not show, and the page's own error lines
        raise AssertionError(f"the page did not show {what} within 20 s; its errors: "
                             f"{texts(driver, '#errors li')}") from e


def texts(driver, selector: str) -> list[str]:
    return [e.text for e in driver.find_elements("css selector", selector)]


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_choosing_a_file_shows_the_label_the_routing_and_the_latency(browser, url, tmp_path):
    layers = httpx.post(f"{url}/v1/routing", params={"model": "digits"}, content=SEVEN.read_bytes(),
                        headers={"content-type": "image/png"}, timeout=30).json()["results"][0]["layers"]
    assert layers, "the default model must have Soft MoE layers for the page to draw"

    browser.get(f"{url}/")
    browser.find_element("css selector", "input[type=file]#file").send_keys(str(SEVEN))  # no click
    wait(browser, lambda d: texts(d, "#predictions .label")[:1] == ["7"], "the label 7")
    wait(browser, lambda d: d.find_elements("css selector", "#routing canvas.routing-map"), "routing maps")
    assert browser.find_element("id", "model").get_attribute("value") == "digits"  # the first classifier
    maps = browser.find_elements("css selector", "#routing canvas.routing-map")
    assert len(texts(browser, "#routing .layer")) == len(layers)
    assert len(maps) == len(layers) * 4
    drawn = browser.execute_script(  # the heat is painted, over the picture itself
        "const c = arguments[0], d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let alpha = 0; for (let i = 3; i < d.length; i += 4) alpha = Math.max(alpha, d[i]);"
        "const img = c.parentElement.querySelector('img');"
        "return [c.width, alpha, img.src.startsWith('blob:') && img.complete && img.naturalWidth > 0];", maps[0])
    assert drawn == [len(layers[0]["dispatch"][0][0]), 230, True], drawn

    def latency(d):
        rows = {r.find_element("css selector", "th").text: texts(r, "td.ms")
                for r in d.find_elements("css selector", "#latency tbody tr")}
        return rows if {"classify", "routing"} <= set(rows) else None

    rows = wait(browser, latency, "the latency of classify and routing")
    for request in ("classify", "routing"):
        assert len(rows[request]) == 6 and all(float(ms) >= 0 for ms in rows[request]), rows

    browser.save_screenshot(str(tmp_path / "page.png"))
    if os.environ.get("SOFTMOE_UPDATE_SCREENSHOT") or not SCREENSHOT.exists():
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "page.png", SCREENSHOT)
    assert texts(browser, "#errors li") == []
    assert console_errors(browser) == []


def test_zero_shot_scores_typed_labels(browser, url):
    from selenium.webdriver.support.ui import Select

    browser.get(f"{url}/")
    wait(browser, lambda d: d.find_element("id", "model").get_attribute("value"), "the model list")
    Select(browser.find_element("id", "model")).select_by_value("digits-lit")
    browser.find_element("id", "file").send_keys(str(SEVEN))
    browser.find_element("id", "labels").send_keys("one, seven, two")
    wait(browser, lambda d: sorted(texts(d, "#predictions .label")) == ["one", "seven", "two"], "three label scores")
    assert texts(browser, "#predictions .label")[0] == "seven"
    assert all(0 <= float(s) <= 1 for s in texts(browser, "#predictions .score"))
    wait(browser, lambda d: d.find_elements("css selector", "#routing canvas.routing-map"), "digits-lit's routing")
    assert texts(browser, "#errors li") == []
    assert console_errors(browser) == []


def test_dropping_a_file_runs_it_too(browser, url):
    browser.get(f"{url}/")
    browser.execute_script(  # what a drop from the desktop dispatches: a DragEvent carrying the file
        "const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0)), files = new DataTransfer();"
        "files.items.add(new File([bytes], 'seven.png', {type: 'image/png'}));"
        "document.getElementById('drop').dispatchEvent("
        "  new DragEvent('drop', {dataTransfer: files, bubbles: true, cancelable: true}));",
        base64.b64encode(SEVEN.read_bytes()).decode())
    wait(browser, lambda d: texts(d, "#predictions .label")[:1] == ["7"], "the label 7")
    wait(browser, lambda d: d.find_elements("css selector", "#routing canvas.routing-map"), "routing maps")
    assert console_errors(browser) == []


def test_a_server_error_is_shown_on_the_page(browser, url):
    browser.get(f"{url}/")
    wait(browser, lambda d: d.find_element("id", "model").get_attribute("value"), "the model list")
    browser.find_element("id", "file").send_keys(str(Path(__file__)))  # not an image
    errors = wait(browser, lambda d: texts(d, "#errors li"), "an error line")
    assert any(line.startswith("classify: ") and "HTTP 4" in line for line in errors), errors
    browser.get_log("browser")  # the refused requests are logged by the browser itself


def test_a_server_with_an_api_key_asks_for_it_and_sends_it(browser):
    """--api-key: the page's first request gets 401; the page shows its key form, says when a key is
    refused, and sends the accepted key as a Bearer header with every request after it."""
    with live_server(create_app(Settings(api_key="page-key", grpc_port=0))) as keyed:
        browser.get(f"{keyed}/")
        form = wait(browser, lambda d: d.find_element("id", "key-form").is_displayed(), "the key form")
        assert form and "needs an API key" in browser.find_element("id", "key-why").text
        browser.find_element("id", "api-key").send_keys("wrong-key\n")
        wait(browser, lambda d: "not accepted" in d.find_element("id", "key-why").text, "the refusal of a wrong key")
        browser.find_element("id", "api-key").send_keys("page-key\n")
        wait(browser, lambda d: d.find_element("id", "model").get_attribute("value") == "digits", "the model list")
        assert not browser.find_element("id", "key-form").is_displayed()
        browser.find_element("id", "file").send_keys(str(SEVEN))
        wait(browser, lambda d: texts(d, "#predictions .label")[:1] == ["7"], "the label 7")
        assert texts(browser, "#errors li") == []
        browser.execute_script("sessionStorage.clear()")
        browser.get_log("browser")  # the 401s are logged by the browser itself


def test_a_model_without_routing_says_so_in_one_line(browser):
    with live_server(create_app(Settings(backend="torch", routing=False))) as plain:  # no /v1/routing maps
        browser.get(f"{plain}/")
        browser.find_element("id", "file").send_keys(str(SEVEN))
        wait(browser, lambda d: texts(d, "#predictions .label")[:1] == ["7"], "the label 7")
        line = wait(browser, lambda d: texts(d, "#routing .no-routing"), "the no-routing line")
        assert line[0].startswith("No routing maps: model 'digits' (classifier) cannot show routing"), line
        assert "\n" not in line[0] and not browser.find_elements("css selector", "#routing canvas")
        assert texts(browser, "#errors li") == []
        browser.get_log("browser")  # the 422 is logged by the browser itself


def test_a_sparse_model_shows_its_experts_and_drops(browser, tmp_path):
    """A sparse V-MoE package (converted from vmoe's golden Tokens Choice model): the page draws
    its most loaded experts' combine weights over the picture and says how many choices dropped."""
    import numpy as np

    from conftest import SHARED
    from helpers.images import png
    from softmoe_models.convert import convert_checkpoint

    src = SHARED / "golden" / "vmoe-sparse" / "vmoe_tc_e8k2.npz"
    if not src.is_file():
        pytest.skip(f"golden data not found at {src}")
    package, _ = convert_checkpoint(src, tmp_path / "tc", router="tokens-choice", experts_per_token=2,
                                    capacity_factor=1.05)
    with np.load(src) as d:
        image = tmp_path / "image.png"
        image.write_bytes(png(d["inputs/images_uint8"][0]))
    settings = Settings(models=[f"tc={package}"], backend="torch", cache_dir=str(tmp_path / "cache"))
    with live_server(create_app(settings)) as sparse:
        routing = httpx.post(f"{sparse}/v1/routing", params={"model": "tc"}, content=image.read_bytes(),
                             headers={"content-type": "image/png"}, timeout=30).json()["results"][0]["layers"]
        browser.get(f"{sparse}/")
        browser.find_element("id", "file").send_keys(str(image))
        wait(browser, lambda d: texts(d, "#predictions .label"), "the predictions")
        maps = wait(browser, lambda d: d.find_elements("css selector", "#routing canvas.routing-map"), "expert maps")
        titles = texts(browser, "#routing .layer h3")
        assert len(titles) == len(routing) == 2
        for title, layer in zip(titles, routing):
            assert title.startswith(f"layer {layer['layer']}: {layer['dropped_total']} of 34 token choices dropped")
        assert len(maps) == sum(min(4, sum(1 for n in layer["expert_load"] if n)) for layer in routing)
        assert maps[0].get_attribute("width") == "4" and "tokens-choice" in texts(browser, "#routing .note")[0]
        assert texts(browser, "#errors li") == [] and console_errors(browser) == []
