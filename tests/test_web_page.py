"""The chat page of `edgespec serve` in a real headless Chromium, driven by Playwright.

Skipped, with the reason, where Playwright or a Chromium binary is missing (make test
installs Debian's chromium where apt-get works; EDGESPEC_CHROMIUM names another binary).
"""
import http.client
import json
import os
import re
import shutil
import time

import pytest
from helpers import health, start_server, stop_server, wait_idle

from edgespec.apps.server.openai_api import chat_chunk

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
    process, port = start_server(long_artifact, "--allow-ignore-eos", "--parallel", "2")
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


def shown_as(page, markdown):
    """The text the page shows for a reply of this markdown."""
    return page.evaluate("""(text) => {
        const element = document.createElement('div');
        renderMarkdown(element, text);
        return element.textContent;
    }""", markdown)


def stream_body(*pieces) -> str:
    """Server-sent events as the server streams a chat reply made of these pieces."""
    chunks = [chat_chunk("chatcmpl-1", "art", {"role": "assistant", "content": ""}),
              *(chat_chunk("chatcmpl-1", "art", {"content": piece}) for piece in pieces),
              chat_chunk("chatcmpl-1", "art", {}, "stop")]
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


def answer_with(page, *pieces):
    """From now on the page's chat requests get this reply, not the random model's: the
    real server serves the page, the reply's text is the test's."""
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, content_type="text/event-stream", body=stream_body(*pieces)))


def open_page(page, expect, port):
    page.goto(f"http://127.0.0.1:{port}/")
    expect(page.locator("#model")).to_have_text("art")


def chat(page, expect, text):
    """Send a message and wait for the whole reply."""
    request = send(page, text)
    expect(page.locator("#send")).to_be_enabled()
    return request


CODE = "def square(x):\n    return x * x\n"
FENCED = ("Here it is:\n\n```python\n", CODE[:15], CODE[15:], "```\n\nDone.")


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
    shown = reply.locator(".text").text_content()
    assert page.evaluate("window.textUpdates") > 1, "the reply came in one piece"
    # the second turn carries the first, and the mode chosen in the settings
    page.select_option("#mode", "plain")
    second = send(page, "and then?").post_data_json
    text = second["messages"][1]["content"]
    assert second["messages"] == [{"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": text},
                                  {"role": "user", "content": "and then?"}]
    assert text and shown_as(page, text) == shown
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
    assert [m["role"] for m in following["messages"]] == ["user", "assistant", "user"]
    assert shown_as(page, following["messages"][1]["content"]) == shown  # what the user saw
    expect(last_reply(page).locator(".stats")).to_contain_text("tokens/s")
    assert health(server)["failed"] == 0


def test_two_tabs_stream_their_own_replies_at_once(playwright, expect, server):
    _, browser = playwright
    context = browser.new_context()  # one browser, two tabs: one storage, two conversations
    tabs = [context.new_page() for _ in range(2)]

    def long_reply(route):  # the random model may end its turn at any token: make it go on
        route.continue_(post_data=json.dumps({**route.request.post_data_json,
                                              "ignore_eos": True}))
    try:
        before = wait_idle(server)
        for tab, text in zip(tabs, ("from the first tab", "from the second tab")):
            open_page(tab, expect, server)
            tab.fill("#max_tokens", "600")
            tab.route("**/v1/chat/completions", long_reply)
            send(tab, text)
        deadline = time.monotonic() + REPLY_S
        while health(server)["running"] < 2:  # both replies decode together
            assert time.monotonic() < deadline, "the two tabs' replies never ran together"
            time.sleep(0.01)
        for tab in tabs:
            expect(tab.locator("#send")).to_be_enabled()
            expect(last_reply(tab).locator(".stats")).to_contain_text("tokens/s")
        after = wait_idle(server)
        assert after["completed"] == before["completed"] + 2 and after["failed"] == 0
        for tab, text in zip(tabs, ("from the first tab", "from the second tab")):
            tab.reload()  # each tab keeps its own conversation
            expect(tab.locator(".message.user .text")).to_have_text(text)
            expect(tab.locator(".message")).to_have_count(2)
    finally:
        context.close()


def test_a_fenced_code_block_in_a_reply_shows_as_monospace_code(page, expect, server):
    open_page(page, expect, server)
    answer_with(page, *FENCED)
    chat(page, expect, "a square function?")
    code = last_reply(page).locator("pre > code")
    expect(code).to_have_count(1)
    assert code.text_content() == CODE
    assert "monospace" in code.evaluate("(e) => getComputedStyle(e).fontFamily")
    expect(last_reply(page).locator("p").first).to_have_text("Here it is:")


def test_the_copy_button_puts_the_code_on_the_clipboard(page, expect, server):
    page.context.grant_permissions(["clipboard-read", "clipboard-write"],
                                   origin=f"http://127.0.0.1:{server}")
    open_page(page, expect, server)
    answer_with(page, *FENCED)
    chat(page, expect, "a square function?")
    copy = last_reply(page).locator(".code-block button.copy")
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == CODE
    expect(copy).to_have_text("Copy")  # back, ready for the next copy


def test_markup_in_a_reply_is_shown_inert(page, expect, server):
    open_page(page, expect, server)
    answer_with(page, "look: <img src=x onerror=\"window.injected = 1\">",
                "<script>window.injected = 2</script> ",
                "[link](javascript:window.injected=3) <b onclick=\"window.injected = 4\">b</b>")
    chat(page, expect, "html?")
    reply = last_reply(page)
    expect(reply.locator("img")).to_have_count(1)  # rendered as HTML, less what runs
    assert reply.locator("img").get_attribute("onerror") is None
    assert reply.locator("b").get_attribute("onclick") is None
    assert reply.locator("script").count() == 0
    assert reply.locator("a").get_attribute("href") in (None, "")
    reply.locator("a").click()
    reply.locator("b").click()
    assert page.evaluate("window.injected") is None


def test_a_reload_keeps_the_conversation(page, expect, server):
    open_page(page, expect, server)
    answer_with(page, *FENCED)
    chat(page, expect, "a square function?")
    page.reload()
    expect(page.locator(".message")).to_have_count(2)
    expect(page.locator(".message.user .text")).to_have_text("a square function?")
    expect(last_reply(page).locator("pre > code")).to_have_text(CODE)  # as markdown again
    following = chat(page, expect, "and a cube?").post_data_json
    assert following["messages"] == [{"role": "user", "content": "a square function?"},
                                     {"role": "assistant", "content": "".join(FENCED)},
                                     {"role": "user", "content": "and a cube?"}]


def test_new_chat_clears_the_conversation_and_its_stored_copy(page, expect, server):
    open_page(page, expect, server)
    answer_with(page, "first reply")
    chat(page, expect, "hello")
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    page.reload()
    expect(page.locator("#model")).to_have_text("art")
    expect(page.locator(".message")).to_have_count(0)
    assert [m["role"] for m in chat(page, expect, "again").post_data_json["messages"]] == ["user"]


def test_a_corrupt_stored_conversation_is_dropped(page, expect, server):
    open_page(page, expect, server)
    for stored in ("{not json", '{"role": "user"}', '[{"role": "tool", "content": "x"}]'):
        page.evaluate("(value) => sessionStorage.setItem('edgespec.conversation', value)",
                      stored)
        page.reload()
        expect(page.locator("#model")).to_have_text("art")
        expect(page.locator(".message")).to_have_count(0)
        assert page.evaluate("sessionStorage.getItem('edgespec.conversation')") is None


@pytest.mark.parametrize("path", ["/favicon.ico", "/favicon.svg"])
def test_the_favicon_is_an_svg_image(server, path):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    assert response.status == 200
    assert response.getheader("Content-Type") == "image/svg+xml"
    assert body.startswith(b"<svg")


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
