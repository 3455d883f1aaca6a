"""`edgespec chat` through a pseudo-terminal, and the multi-turn Python API."""
import io
import os
import re
import signal
import sys

import pexpect
import pytest

import edgespec
from edgespec.chat import ChatSession

SUMMARY = r"\[\d+ tokens, [\d.]+ tokens/s, accepted \d+/\d+ \(\d+%\), [\d.]+ tokens/round"


def spawn_chat(artifact, *args, timeout=60):
    # surrogateescape: a test can type bytes that are not UTF-8 ("\udcff" is the byte 0xff)
    child = pexpect.spawn(sys.executable, ["-m", "edgespec", "chat", str(artifact), *args],
                          encoding="utf-8", codec_errors="surrogateescape", timeout=timeout,
                          dimensions=(40, 200))
    child.expect("you> ")
    return child


def test_chat_streams_replies_runs_commands_and_leaves_on_ctrl_d(tiny_int4):
    child = spawn_chat(tiny_int4, "--max-new-tokens", "24", "--show-drafts")
    child.logfile_read = transcript = io.StringIO()
    child.sendline("hello there")
    child.expect(SUMMARY)
    accepted = int(re.search(r"accepted (\d+)/", child.after).group(1))
    assert ("\x1b[32m" in transcript.getvalue()) == (accepted > 0)  # drafted text in green
    child.expect("you> ")
    child.sendline("/set temperature 0.7")
    child.expect(r"\[temperature = 0.7\]")
    child.sendline("/set top_p 7")
    child.expect(r"\[not set: invalid top-p 7.0")
    child.sendline("/stats")
    child.expect(r"prefilled \d+ of \d+ prompt tokens")
    child.sendline("and again")
    child.expect(SUMMARY)
    child.sendline("/reset")
    child.expect(r"\[conversation cleared\]")
    child.sendline("/help")
    child.expect("/set NAME VALUE")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_exit_command_leaves_cleanly(tiny_int4):
    child = spawn_chat(tiny_int4)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(tiny_int4):
    child = spawn_chat(tiny_int4, "--max-new-tokens", "4")
    child.sendline("caf\udce9")  # "café" in Latin-1
    child.expect(r"\[that line is not valid UTF-8 \(byte 0xe9 at character 3\).*nothing was "
                 r"sent\]")
    child.expect("you> ")
    child.sendline("hello")
    child.expect(r"\[\d+ tokens")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


class CtrlCOnWrite(io.StringIO):
    """A terminal whose user presses Ctrl-C once the next reply starts printing."""
    armed = False

    def write(self, text):
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


def test_stats_after_ctrl_c_shows_the_stopped_reply(tiny_int4):
    model = edgespec.load(tiny_int4)
    model.stop_ids = set()  # replies run to max_new_tokens unless stopped
    out = CtrlCOnWrite()
    session = ChatSession(model, {"max_new_tokens": 40, "temperature": 0}, out=out)
    session.turn("hello there")
    finished = session.last
    out.armed = True
    session.turn("and again")
    stopped = session.last
    assert stopped is not finished and stopped.finish_reason == "cancelled"
    assert stopped.n_generated < finished.n_generated == 40
    session.command("/stats")
    assert f"[last reply (stopped with Ctrl-C): {stopped.n_generated} tokens" in out.getvalue()


def test_a_full_context_drops_the_oldest_turns_without_a_crash(tiny_checkpoint, tmp_path):
    from helpers import quiet

    from edgespec.export.pipeline import export_model
    export_model(str(tiny_checkpoint), tmp_path / "small", max_context=96, log=quiet)
    child = spawn_chat(tmp_path / "small", "--max-new-tokens", "20")
    child.logfile_read = transcript = io.StringIO()
    for turn in range(6):
        child.sendline(f"turn {turn}: the quick brown fox jumps over the lazy dog")
        child.expect(r"\[\d+ tokens")
        child.expect("you> ")
    assert "the oldest turn was dropped" in transcript.getvalue()
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.smollm2
def test_ctrl_c_stops_a_reply_and_keeps_the_conversation(smollm2_int4):
    child = spawn_chat(smollm2_int4, "--max-new-tokens", "3000", timeout=120)
    child.sendline("Write a very long story about a dragon who learns to bake bread.")
    child.expect("bake bread.\r\n")  # the echo of the line
    child.expect(r"\w+ \w+ \w+ \w+")  # the reply is streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect("you> ")
    child.sendline("/set max_new_tokens 16")
    child.expect("you> ")
    child.sendline("What was the story about?")
    child.expect(r"\[\d+ tokens, [\d.]+ tokens/s")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


@pytest.mark.smollm2
def test_a_new_turn_prefills_only_its_new_tokens(smollm2_int4):
    model = edgespec.load(smollm2_int4)
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    first = model.chat(messages, max_new_tokens=256, seed=0)
    assert first.n_prefilled == first.n_prompt and first.finish_reason == "stop"
    held = model.sequence.cached_tokens()
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "And a red one?"}]
    ids = model.codec.encode_chat(messages)
    # the cache holds the first prompt and the reply; the reply's text encodes to the
    # model's own tokens unless the model split a word another way than the tokenizer
    # would ("h|uge|list" for "h|ug|elist"), and the cache is reused up to there
    assert held[:first.n_prompt] == ids[:first.n_prompt]
    common = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), len(held))
    second = model.chat(messages, max_new_tokens=24, seed=1)
    # all of the common start is reused: only the rest runs through the model
    assert second.n_prefilled == second.n_prompt - common
    assert common > first.n_prompt and second.n_prefilled < second.n_prompt - first.n_prompt
    # decode steps leave the same bits in the cache as a prefill would: a continued chat
    # answers exactly as the same conversation sent afresh (with the same seed)
    fresh = edgespec.load(smollm2_int4).chat(messages, max_new_tokens=24, seed=1)
    assert fresh.n_prefilled == fresh.n_prompt and fresh.tokens == second.tokens


def test_chat_streams_text_and_reports_the_result(tiny_int4):
    model = edgespec.load(tiny_int4)
    stream = model.chat([{"role": "user", "content": "hi"}], stream=True, max_new_tokens=12)
    text = "".join(stream)
    assert stream.result is not None and stream.result.text == text
    assert stream.result.stats.rounds >= 1
