"""A vLLM server whose connection breaks while it loads weights is "stuck" (kept out until restarted)
only while it still accepts connections; one whose process is gone is just down: the driver sees it
exit and restarts it, with no hang report."""

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prl.backends.vllm.client import VllmBackend


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_accepts_no_connection_is_gone_and_one_that_answers_is_not():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def probe(url: str) -> bool:
        client = VllmBackend(url, "secret")
        try:
            return await client.gone()
        finally:
            await client.close()

    try:
        assert asyncio.run(probe(f"http://127.0.0.1:{server.server_address[1]}")) is False
    finally:
        server.shutdown()
        server.server_close()
    assert asyncio.run(probe(f"http://127.0.0.1:{free_port()}")) is True
