"""A small desktop chat window that embeds the edgespec runtime in-process.

The model runs on a worker thread and hands text pieces to the Tk main loop through a
queue, which the window polls; so the window keeps redrawing and answering while a reply
streams. Stop ends a reply where it is; what came stays in the conversation. Run:
edgespec desktop models/smollm2-135m-instruct
"""
import argparse
import queue
import threading
import tkinter as tk
from tkinter import scrolledtext

import edgespec

POLL_MS = 30


def stats_line(result) -> str:
    """A reply's numbers for the status line."""
    return " \u00b7 ".join(result.summary()) + \
        (" (stopped)" if result.finish_reason == "cancelled" else "")


class ChatWindow:
    def __init__(self, root: tk.Tk, model, max_new_tokens: int = 256, **options):
        """options: generation options for Model.chat (temperature, draft_k, mode, stop, ...)."""
        self.root, self.model, self.max_new_tokens = root, model, max_new_tokens
        self.options = options
        self.messages, self.pieces, self.busy = [], queue.Queue(), False
        self.reply = []  # the text pieces of the last reply, as shown
        self.last = None  # the last reply's Generation
        self.stopping = threading.Event()  # set by Stop, read by the worker between pieces
        root.title(f"edgespec - {model.artifact.path.name}")
        self.log = scrolledtext.ScrolledText(root, wrap="word", state="disabled", width=72,
                                             height=20)
        self.log.tag_configure("user", foreground="#1f4e99")
        self.entry = tk.Entry(root, width=60)
        self.send_button = tk.Button(root, text="Send", command=self.send)
        self.stop_button = tk.Button(root, text="Stop", command=self.stop, state="disabled")
        self.status = tk.Label(root, text="ready", anchor="w")
        self.log.grid(row=0, column=0, columnspan=3, sticky="nsew", padx=6, pady=6)
        self.entry.grid(row=1, column=0, sticky="ew", padx=6)
        self.send_button.grid(row=1, column=1, padx=(6, 0))
        self.stop_button.grid(row=1, column=2, padx=6)
        self.status.grid(row=2, column=0, columnspan=3, sticky="ew", padx=6, pady=(2, 6))
        root.columnconfigure(0, weight=1)
        root.rowconfigure(0, weight=1)
        self.entry.bind("<Return>", lambda event: self.send())
        self.entry.focus_set()
        root.after(POLL_MS, self._poll)

    def send(self, text: str = None):
        """Send the entry's text (or `text`) as the next user message."""
        text = (text if text is not None else self.entry.get()).strip()
        if not text or self.busy:
            return
        self.entry.delete(0, "end")
        self._append(f"you: {text}\n", "user")
        self._append("assistant: ")
        self.reply = []
        self.messages.append({"role": "user", "content": text})
        self.busy = True
        self.stopping.clear()
        self.send_button.configure(state="disabled")
        self.stop_button.configure(state="normal")
        self.status.configure(text="thinking...")
        threading.Thread(target=self._generate, args=(list(self.messages),), daemon=True).start()

    def stop(self):
        """End the reply being generated, at the next piece."""
        if self.busy:
            self.stopping.set()
            self.status.configure(text="stopping...")

    def _generate(self, messages):
        """On the worker thread: stream the reply into the queue, then its result."""
        try:
            stream = self.model.chat(messages, stream=True, max_new_tokens=self.max_new_tokens,
                                     **self.options)
            for piece in stream:
                self.pieces.put(piece)
                if self.stopping.is_set():
                    stream.stop()  # its Generation so far, numbers included
                    break
            self.pieces.put(stream.result)
        except Exception as e:  # shown in the status line; the window must not stay busy
            self.pieces.put(e)

    def _poll(self):
        """On the Tk thread: show what the worker produced since the last poll. Only what
        was queued when the poll began: a worker faster than the drawing would otherwise
        keep this loop going to the end of the reply, and Stop could not be pressed."""
        for _ in range(self.pieces.qsize()):
            item = self.pieces.get_nowait()
            if isinstance(item, str):
                self.reply.append(item)
                self._append(item)
            else:
                self._finish(item)
        self.root.after(POLL_MS, self._poll)

    def _finish(self, result):
        self._append("\n\n")
        if isinstance(result, Exception):
            self.messages.pop()  # no reply: the next message must not follow it unanswered
            self.status.configure(text=f"error: {result} (that message was not kept)")
        else:  # a stopped reply stays as far as it was shown, so the next turn answers that
            self.last = result
            text = "".join(self.reply) if result.finish_reason == "cancelled" else result.text
            self.messages.append({"role": "assistant", "content": text})
            self.status.configure(text=stats_line(result))
        self.busy = False
        self.send_button.configure(state="normal")
        self.stop_button.configure(state="disabled")

    def _append(self, text, tag=None):
        self.log.configure(state="normal")
        self.log.insert("end", text, tag)
        self.log.see("end")
        self.log.configure(state="disabled")

    def transcript(self) -> str:
        return self.log.get("1.0", "end")


def run(model, max_new_tokens: int = 256, **options):
    """Open a chat window on `model` and run the Tk loop until the window is closed."""
    try:
        root = tk.Tk()
    except tk.TclError as e:  # no display: say so in the user's terms
        raise edgespec.EdgespecError(f"cannot open a window ({e}): run it on a desktop, or "
                                     "set DISPLAY to a running X server") from e
    ChatWindow(root, model, max_new_tokens, **options)
    root.mainloop()


def main(argv=None):
    """`python -m edgespec.apps.desktop.chat_window ARTIFACT`: `edgespec desktop` has more."""
    parser = argparse.ArgumentParser(description="A desktop chat window on an edgespec artifact.")
    parser.add_argument("artifact")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    run(edgespec.load(args.artifact), args.max_new_tokens)


if __name__ == "__main__":
    main()
