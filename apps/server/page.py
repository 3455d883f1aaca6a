"""The chat page at `/`: static files shipped inside the package, read once at start.

No build step and nothing from a CDN: the page is plain HTML, CSS and JavaScript that
talks to this server's own /v1/chat/completions. Replies are markdown, rendered by two
vendored libraries, unmodified from their npm packages (licenses beside them in vendor/):
marked 18.3.0 (lib/marked.umd.js, MIT) turns it into HTML and DOMPurify 3.5.0
(dist/purify.min.js, Apache-2.0 or MPL-2.0) strips from that HTML anything that could run.
Only the files listed here are served, by exact path, so no request path reaches the
file system.
"""
from importlib import resources

FILES = {"/": "index.html", "/chat.js": "chat.js", "/chat.css": "chat.css",
         "/vendor/marked.umd.js": "vendor/marked.umd.js",
         "/vendor/purify.min.js": "vendor/purify.min.js",
         "/favicon.svg": "favicon.svg", "/favicon.ico": "favicon.svg"}  # browsers ask for .ico
TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8",
         "css": "text/css; charset=utf-8", "svg": "image/svg+xml"}
# the page runs only its own files, cannot be framed, and sends no referrer
HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def load_page() -> dict:
    """URL path -> (content type, bytes) for every file of the page."""
    static = resources.files(__package__) / "static"
    return {path: (TYPES[name.rsplit(".", 1)[1]], (static / name).read_bytes())
            for path, name in FILES.items()}
