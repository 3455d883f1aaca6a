"""Progress bars for the long phases of export, with counts and an ETA.

On a terminal the bar redraws in place; when stderr is a file or a pipe (CI, `nohup`), it
still reports, one line every LOG_INTERVAL seconds and one at the end, so a long export
never looks hung.
"""
import sys

from tqdm import tqdm

LOG_INTERVAL = 15.0


class _Lines:
    """A file for tqdm that turns each redraw into a line of its own."""

    def write(self, text):
        text = text.replace("\r", "").strip()
        if text:
            print(text, file=sys.stderr, flush=True)

    def flush(self):
        sys.stderr.flush()


def progress(total, desc, unit="it", **kwargs):
    """A tqdm bar on stderr that is never silently disabled."""
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=False,
                    dynamic_ncols=True, **kwargs)
    return tqdm(total=total, desc=desc, unit=unit, file=_Lines(), disable=False,
                mininterval=LOG_INTERVAL, ncols=100, **kwargs)
