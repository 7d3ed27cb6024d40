"""The trainer endpoint: a small HTTP server on trainer rank 0, the one network door of the trainer.

- `PUT /rollouts/{step}`: a packed batch from the orchestrator (bytes of `torch.save`). The whole
  body must arrive (Content-Length) and be a well-formed batch for that step (ranks, shapes, ids in
  the vocabulary, finite numbers) or it is refused with 400; it lands in the rank-0 inbox by rename, so the
  trainer sees a whole batch or none. A repeated PUT for a step replaces it (senders retry).
- `GET /resume`: where a (re)started orchestrator continues: `{"step", "data_position", "data_ahead"}`,
  the step after the last batch the inbox holds in a row from the trainer's checkpoint, and that
  batch's data cursor (503 until known).
- `GET /weights/latest?after=N&wait=S`: the newest sealed weight version, waiting up to S seconds
  for one newer than N (long poll, so new weights are relayed without a polling delay).
- `GET /weights/v{N}/{file}`: a file of a sealed version; only names listed in its manifest.
- `PUT /finished`: the orchestrator has shipped every batch and logged every eval; a trainer that
  waits for it (an eval set scores the final weights) exits after it (`wait_finished`).

Why an endpoint on rank 0 and not a store: the trainer already owns the batch inbox and the sealed
weight folders, so no extra service has to be placed, started and kept alive on 28 hosts, and
rank 0 scatters each step's micro-batches to the other ranks over the trainer's own process group.
Every request needs `Authorization: Bearer <run secret>`. stdlib only: a thread per request.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from prl.model.weights import MANIFEST, published_versions, version_dir
from prl.transport import ports
from prl.transport.auth import UNAUTHORIZED, bearer_ok
from prl.transport.batch import BadBatch, load_batch
from prl.transport.rollouts import FilesystemRolloutTransport

FILE_RE = re.compile(r"^/weights/v(\d+)/([\w.-]+)$")
MAX_WAIT_S = 30.0
FINISHED = "orchestrator-finished"  # in the run directory: the orchestrator logged every eval (holds max_steps)
RESCAN_S = 1.0  # a long poll looks at the folder again this often without a `sealed` notice


class TrainerEndpoint:
    def __init__(self, run_dir: Path, secret: str, host: str, port: int, world: int | None = None,
                 vocab_size: int | None = None, fallback: bool = False, name: str | None = None,
                 trees: bool = True, max_steps: int = -1):
        """`world`, `vocab_size`, `trees` (shared-prompt rows trainable: no context parallelism): what an
        arriving batch is checked against (None: not checked).
        `fallback`: another free port when `port` is taken; `name`: publish the port got under this
        name in the run directory (`prl.transport.ports`).
        `max_steps`: the run's steps, which a `PUT /finished` is remembered for (a run resumed with more
        steps waits for the orchestrator again)."""
        self.inbox = FilesystemRolloutTransport(Path(run_dir) / "rollouts")
        self.world, self.vocab_size, self.trees = world, vocab_size, trees
        self.weights_root = Path(run_dir) / "weights"
        self.secret = secret
        self.base: tuple[int, int] | None = None  # (step, data position) of the trainer's checkpoint
        self.positions: dict[int, int] = {}  # step -> data position of a batch in the inbox
        self._sealed = threading.Condition()  # notified by the trainer as it seals a version
        self._seals = 0
        self.finished = threading.Event()
        self.max_steps = max_steps
        endpoint = self

        class Handler(_Handler):
            ep = endpoint

        self.server = ThreadingHTTPServer((host, port), Handler, bind_and_activate=False)
        self.server.socket.close()
        self.server.socket = ports.bind(host, port, fallback)
        self.server.server_address = self.server.socket.getsockname()
        self.server.daemon_threads = True
        self.run_dir, self.name, self.host = Path(run_dir), name, host
        # a short poll: `stop` waits for the serving loop to see it (the trainer's last act before it exits)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="trainer-endpoint",
                                       daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> TrainerEndpoint:
        self.thread.start()
        if self.name:
            ports.publish(self.run_dir, self.name, self.host, self.port)
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def set_base(self, step: int, data_position: int, data_ahead: list[int] = ()) -> None:
        self.base = (step, (data_position, list(data_ahead)))

    def resume(self) -> dict | None:
        """The first step with no batch yet: batches after the checkpoint are kept (the trainer
        replays them after a restart), so a restarted orchestrator must not ship them again."""
        if self.base is None:
            return None
        base = self.base
        step, position = base
        while self.inbox.path(step).exists():
            if step not in self.positions:
                try:
                    self.positions[step] = self.inbox.data_position(step)
                except (OSError, RuntimeError):  # discarded under us by a checkpoint: walk from its base
                    if self.base != base:
                        return self.resume()
                    break
            position = self.positions[step]  # a later batch's cursor supersedes (it never goes back)
            step += 1
        return {"step": step, "data_position": position[0], "data_ahead": position[1]}

    def mark_finished(self) -> None:
        """The orchestrator is done: remembered on disk, so a trainer restarted after it still ends."""
        (self.run_dir / FINISHED).write_text(str(self.max_steps))
        self.finished.set()

    def wait_finished(self) -> None:
        """Block until the orchestrator says it is done with this run's `max_steps` (`PUT /finished`, now or
        before this process started); the endpoint serves meanwhile."""
        marker = self.run_dir / FINISHED
        if marker.is_file() and marker.read_text().strip() == str(self.max_steps):
            return
        self.finished.wait()

    def sealed(self) -> None:
        """The trainer sealed a weights version: wake the long polls (they read the folder again)."""
        with self._sealed:
            self._seals += 1
            self._sealed.notify_all()

    def latest(self, after: int, wait_s: float) -> int:
        """The newest sealed version, waiting up to `wait_s` for one newer than `after`: woken by
        `sealed`, not by polling the folder (a poll every 20 ms took a fifth of a small trainer's
        CPU); the folder is read again every `RESCAN_S` all the same."""
        deadline = time.monotonic() + min(wait_s, MAX_WAIT_S)
        while True:
            with self._sealed:
                seen = self._seals
            versions = published_versions(self.weights_root)
            newest = versions[-1] if versions else -1
            left = deadline - time.monotonic()
            if newest > after or left <= 0:
                return newest
            with self._sealed:
                self._sealed.wait_for(lambda seen=seen: self._seals != seen, timeout=min(left, RESCAN_S))


class _Handler(BaseHTTPRequestHandler):
    ep: TrainerEndpoint

    def log_message(self, format, *args):
        pass

    def handle_one_request(self):
        """A client that goes away (the orchestrator's long poll at shutdown) is not an error; a
        malformed number in a request is the client's error (400), not a traceback in the log."""
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except ValueError as e:
            self.close_connection = True  # an unread body may follow
            self._reply(400, {"detail": f"bad request: {e}"})

    def _authorized(self) -> bool:
        if bearer_ok(self.headers.get("Authorization", ""), self.ep.secret):
            return True
        self._reply(401, {"detail": UNAUTHORIZED})
        return False

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self):
        if not self._authorized():
            return
        if self.path == "/finished":
            self.ep.mark_finished()
            return self._reply(200, {"finished": True})
        m = re.match(r"^/rollouts/(\d+)$", self.path)
        if not m:
            return self._reply(404, {"detail": f"no such path {self.path}"})
        length = int(self.headers.get("Content-Length", -1))
        data = self.rfile.read(length) if length > 0 else b""
        if length <= 0 or len(data) != length:
            return self._reply(400, {"detail": f"incomplete body: {len(data)} of {length} bytes"})
        step = int(m.group(1))
        try:
            batch = load_batch(data, step, self.ep.world, self.ep.vocab_size, self.ep.trees)
        except BadBatch as e:
            return self._reply(400, {"detail": f"batch {step} refused: {e}"})
        self.ep.positions[step] = (batch.data_position, list(batch.data_ahead))
        self.ep.inbox.put_bytes(step, data)
        self._reply(200, {"step": int(m.group(1)), "bytes": length})

    def do_GET(self):
        if not self._authorized():
            return
        url = urlparse(self.path)
        if url.path == "/resume":
            point = self.ep.resume()
            if point is None:
                return self._reply(503, {"detail": "trainer still loading"})
            return self._reply(200, point)
        if url.path == "/weights/latest":
            q = parse_qs(url.query)
            after, wait = int(q.get("after", ["-1"])[0]), float(q.get("wait", ["0"])[0])
            if not math.isfinite(wait):
                raise ValueError(f"wait = {wait}: a finite number of seconds is required")
            return self._reply(200, {"version": self.ep.latest(after, wait)})
        m = FILE_RE.match(url.path)
        if m:
            return self._send_file(int(m.group(1)), m.group(2))
        self._reply(404, {"detail": f"no such path {url.path}"})

    def _send_file(self, version: int, name: str) -> None:
        folder = version_dir(self.ep.weights_root, version)
        try:
            listed = name == MANIFEST or name in json.loads((folder / MANIFEST).read_text())["files"]
            f = open(folder / name, "rb") if listed else None  # noqa: SIM115 - closed below
        except (OSError, ValueError):
            f = None
        if f is None:
            return self._reply(404, {"detail": f"v{version}/{name} is not a sealed file (pruned?)"})
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            shutil.copyfileobj(f, self.wfile, 1 << 20)
