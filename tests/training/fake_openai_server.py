"""A minimal OpenAI-compatible server for the scripts/train_stage1.sh tests: GET /v1/models and
POST /v1/chat/completions (n canned, unparseable choices). On SIGTERM it writes its exit time
(epoch seconds) to EXIT_FILE and stops.

    python tests/training/fake_openai_server.py PORT EXIT_FILE
"""

import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send({"choices": [{"index": i, "message": {"role": "assistant", "content": "no verdict"}}
                                for i in range(req.get("n", 1))]})

    def log_message(self, *args):
        pass


def main() -> None:
    port, exit_file = int(sys.argv[1]), sys.argv[2]
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)

    def stop(*_):
        with open(exit_file, "w") as f:
            f.write(str(time.time()))
        threading.Thread(target=server.shutdown).start()
    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()


if __name__ == "__main__":
    main()
