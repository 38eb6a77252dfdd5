"""A local HTTP file server for tests (127.0.0.1 only, from a thread)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FileServer:
    """Serves `files` (path -> bytes) on 127.0.0.1 from a thread and counts requests;
    `fail[path] = n` answers the next n requests of that path with HTTP 503 (a transient
    failure) before serving it."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.requests = files, []
        self.fail: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                server.requests.append(self.path)
                if server.fail.get(self.path, 0) > 0:
                    server.fail[self.path] -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                body = server.files.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
