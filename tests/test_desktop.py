"""The desktop app (`edgespec desktop`): a Tk window on a virtual screen embeds the runtime
and streams a reply."""
import os
import re
import shutil
import subprocess
import sys
import time


import edgespec
from helpers import one_error_line, pump


def shown(pieces) -> str:
    """Text as the Tk text widget shows it (it drops NUL characters)."""
    return "".join(pieces).replace("\x00", "").strip()


def test_the_window_streams_a_reply_and_stays_responsive(display, tiny_int4, tmp_path):
    import tkinter as tk

    from edgespec.apps.desktop.chat_window import ChatWindow
    root = tk.Tk()
    # ignore_eos: the random model may end its turn at once; this reply has 200 tokens
    window = ChatWindow(root, edgespec.load(tiny_int4), max_new_tokens=200, ignore_eos=True)
    ticks = []
    def tick():  # a timer on the Tk loop: it keeps firing while the reply is generated
        ticks.append(time.perf_counter())
        root.after(5, tick)
    tick()
    window.send("hello there")
    deadline = time.time() + 30
    while window.busy and time.time() < deadline:
        root.update()
        time.sleep(0.002)
    root.update()
    transcript = window.transcript()
    assert not window.busy, "no reply within 30 s"
    assert "you: hello there" in transcript
    assert "".join(window.reply) and len(window.reply) > 1  # streamed, in pieces
    assert shown(window.reply) == transcript.split("assistant: ", 1)[1].strip()
    assert re.fullmatch(r"200 tokens · [\d.]+ tokens/s · accepted \d+/\d+ \(\d+%\) · "
                        r"[\d.]+ tokens/round", window.status.cget("text"))
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.5  # never frozen
    if shutil.which("xwd"):
        subprocess.run(["xwd", "-root", "-display", display, "-out", str(tmp_path / "window.xwd")])
    root.destroy()


def test_stop_interrupts_a_reply_and_the_conversation_goes_on(display, long_artifact):
    import tkinter as tk

    from edgespec.apps.desktop.chat_window import ChatWindow
    root = tk.Tk()
    # ignore_eos: the random model would end its turn at any token; this reply runs on
    window = ChatWindow(root, edgespec.load(long_artifact), max_new_tokens=4000,
                        ignore_eos=True)
    assert str(window.stop_button.cget("state")) == "disabled"
    window.send("go")
    pump(root, lambda: len(window.reply) > 0)
    window.stop_button.invoke()
    pump(root, lambda: not window.busy)
    status = window.status.cget("text")
    assert status.endswith("(stopped)") and "tokens/round" in status, status
    assert int(status.split()[0]) < 4000
    assert window.messages == [{"role": "user", "content": "go"},
                               {"role": "assistant", "content": "".join(window.reply)}]
    assert shown(window.reply) == window.transcript().rsplit("assistant: ", 1)[1].strip()
    assert str(window.stop_button.cget("state")) == "disabled"
    # the next turn answers the conversation as shown, as the same one sent afresh would
    window.max_new_tokens = 12
    window.send("more")
    pump(root, lambda: not window.busy)
    fresh = edgespec.load(long_artifact).chat(window.messages[:3], max_new_tokens=12,
                                              ignore_eos=True)
    assert window.messages[3] == {"role": "assistant", "content": fresh.text}
    assert not window.status.cget("text").endswith("(stopped)")
    root.destroy()


def test_edgespec_desktop_opens_the_window_with_the_options_given(display, tiny_int4,
                                                                   monkeypatch):
    import tkinter as tk

    from edgespec.apps.desktop import chat_window
    from edgespec.cli import main
    windows, real = [], chat_window.ChatWindow

    def window(*args, **kwargs):
        windows.append(real(*args, **kwargs))
        return windows[-1]

    def mainloop(root):  # in place of a user: one message, its reply, then close
        windows[0].send("hello")
        pump(root, lambda: not windows[0].busy)
        root.destroy()
    monkeypatch.setattr(chat_window, "ChatWindow", window)
    monkeypatch.setattr(tk.Tk, "mainloop", mainloop)
    assert main(["desktop", str(tiny_int4), "--mode", "plain", "--max-new-tokens", "5",
                 "--temperature", "0", "--threads", "1"]) == 0
    reply = windows[0].last
    assert (reply.mode, reply.sampling["temperature"]) == ("plain", 0.0)
    assert 0 < reply.n_generated <= 5


def test_edgespec_desktop_without_a_display_says_so(tiny_int4):
    env = {k: v for k, v in os.environ.items() if k != "DISPLAY"}
    result = subprocess.run([sys.executable, "-m", "edgespec", "desktop", str(tiny_int4)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert one_error_line(result.stderr).startswith("error: cannot open a window (")
    assert "DISPLAY" in result.stderr
