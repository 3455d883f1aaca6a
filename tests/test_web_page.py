"""The chat page of `edgespec serve` in a real headless Chromium, driven by Playwright.

Skipped, with the reason, where Playwright or a Chromium binary is missing (make test
installs Debian's chromium where apt-get works; EDGESPEC_CHROMIUM names another binary).
"""
import json
import os
import re
import shutil

import pytest
from helpers import health, start_server, stop_server, wait_idle

KEY = "page-test-key"
REPLY_S = 60  # a reply on a busy 2-core machine


def chromium() -> str:
    for name in (os.environ.get("EDGESPEC_CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    pytest.skip("no Chromium to drive: apt-get install chromium (make test does, where apt "
                "works), or set EDGESPEC_CHROMIUM to a Chromium binary")


@pytest.fixture(scope="module")
def playwright():
    api = pytest.importorskip("playwright.sync_api",
                              reason="playwright is not installed: pip install playwright")
    path = chromium()
    with api.sync_playwright() as driver:
        # root in a container: no sandbox; a small /dev/shm: use /tmp
        browser = driver.chromium.launch(executable_path=path,
                                         args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield api, browser
        browser.close()


@pytest.fixture
def page(playwright):
    _, browser = playwright
    context = browser.new_context()  # fresh storage for every test
    yield context.new_page()
    context.close()


@pytest.fixture
def expect(playwright):
    api, _ = playwright
    api.expect.set_options(timeout=REPLY_S * 1000)
    return api.expect


@pytest.fixture(scope="module")
def server(long_artifact):
    process, port = start_server(long_artifact, "--allow-ignore-eos")
    yield port
    stop_server(process)


def send(page, text):
    """Type a message and press Enter; the request the page sent, as JSON."""
    page.fill("#prompt", text)
    with page.expect_request("**/v1/chat/completions") as request:
        page.press("#prompt", "Enter")
    return request.value


def last_reply(page):
    return page.locator(".message.assistant").last


def count_text_updates(page):
    """From now on, count the changes to replies' text (one per streamed piece)."""
    page.evaluate("""() => {
        window.textUpdates = 0;
        new MutationObserver((records) => { window.textUpdates += records.filter(
            (r) => r.target.classList && r.target.classList.contains('text')).length; })
          .observe(document.getElementById('conversation'), {childList: true, subtree: true});
    }""")


def test_the_page_streams_replies_with_their_speed_and_acceptance(page, expect, server):
    page.goto(f"http://127.0.0.1:{server}/")
    expect(page.locator("#model")).to_have_text("art")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "24")
    count_text_updates(page)
    first = send(page, "hello").post_data_json
    assert first["stream"] and first["stream_options"] == {"include_usage": True}
    assert (first["temperature"], first["max_tokens"], first["mode"]) == (0, 24, "speculative")
    assert "top_p" not in first  # left blank: the model's default
    reply = last_reply(page)
    expect(reply.locator(".stats")).to_contain_text("accepted/round")
    stats = reply.locator(".stats").inner_text()
    assert re.fullmatch(r"\d+ tokens · [\d.]+ tokens/s · [\d.]+ accepted/round · "
                        r"accepted \d+/\d+ drafts", stats), stats
    text = reply.locator(".text").text_content()
    assert page.evaluate("window.textUpdates") > 1, "the reply came in one piece"
    # the second turn carries the first, and the mode chosen in the settings
    page.select_option("#mode", "plain")
    second = send(page, "and then?").post_data_json
    assert second["messages"] == [{"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": text},
                                  {"role": "user", "content": "and then?"}]
    assert second["mode"] == "plain"
    expect(last_reply(page).locator(".stats")).to_contain_text("tokens/s · plain")
    expect(page.locator("#send")).to_be_enabled()


def test_stop_ends_the_reply_the_server_cancels_it_and_the_chat_goes_on(page, expect, server):

    def long_reply(route):  # the random model may end its turn at any token: make it go on
        route.continue_(post_data=json.dumps({**route.request.post_data_json,
                                              "ignore_eos": True}))

    page.goto(f"http://127.0.0.1:{server}/")
    expect(page.locator("#model")).to_have_text("art")
    page.fill("#max_tokens", "4000")
    page.route("**/v1/chat/completions", long_reply)
    before = wait_idle(server)
    send(page, "go")
    reply = last_reply(page)
    expect(reply.locator(".text")).not_to_be_empty()
    expect(page.locator("#send")).to_be_disabled()
    page.click("#stop")
    expect(reply.locator(".stats")).to_have_text("stopped")
    expect(page.locator("#send")).to_be_enabled()
    after = wait_idle(server)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]  # stopped, not run to its end
    shown = reply.locator(".text").text_content()
    assert shown
    page.unroute("**/v1/chat/completions")
    page.fill("#max_tokens", "4")
    following = send(page, "shorter").post_data_json
    assert following["messages"][1:] == [{"role": "assistant", "content": shown},
                                         {"role": "user", "content": "shorter"}]
    expect(last_reply(page).locator(".stats")).to_contain_text("tokens/s")
    assert health(server)["failed"] == 0


@pytest.fixture(scope="module")
def keyed(tiny_int4):
    process, port = start_server(tiny_int4, "--api-key", KEY)
    yield port
    stop_server(process)


def test_with_an_api_key_the_page_asks_for_it_and_then_chats(page, expect, keyed):
    page.goto(f"http://127.0.0.1:{keyed}/")
    expect(page.locator("#status")).to_contain_text("needs an API key")
    send(page, "hello")
    expect(page.locator("#status")).to_contain_text("401")
    expect(page.locator("#prompt")).to_have_value("hello")  # given back, to send again
    page.fill("#api_key", KEY)
    page.locator("#api_key").dispatch_event("change")
    expect(page.locator("#model")).to_have_text("tiny-int4")
    request = send(page, "hello")
    assert request.headers["authorization"] == f"Bearer {KEY}"
    expect(last_reply(page).locator(".stats")).to_contain_text("tokens/s")
    assert [m["role"] for m in request.post_data_json["messages"]] == ["user"]
    page.reload()  # the key stays for the tab's life
    expect(page.locator("#api_key")).to_have_value(KEY)
    expect(page.locator("#model")).to_have_text("tiny-int4")
