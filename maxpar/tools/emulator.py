"""gcp-storage-emulator (the `test` extra) as a GCS JSON-API server on loopback that TensorStore can use, which can be
stopped and started again on the same port: for the tests (tests/gcs.py), the checkpoint benchmark's bucket tier, and
users (docs/storage.md):

    python -m maxpar.tools.emulator --port 9023 --bucket my-bucket [--data_dir DIR]

runs it in the foreground until Ctrl-C and prints the variable to export in the shells that use it.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from maxpar.core import storage
from maxpar.io import logs

# The emulator as a server TensorStore can use: its media downloads lack the `x-goog-generation` header that GCS sends
# and TensorStore's OCDBT reads ("Malformed StorageGeneration" otherwise), so the launcher adds it.
LAUNCHER = """
import sys
from http import server
# Its single-threaded server queues 5 connections (socketserver's default); clients that open more at once (gcsfs's
# batched copies, renames and reads, TensorStore's) have their connections dropped and retried a second later.
server.HTTPServer.request_queue_size = 1024
from gcp_storage_emulator.handlers import objects
original = objects.download
def download(request, response, storage, *args, **kwargs):
    original(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration") or "1")
objects.download = download
from gcp_storage_emulator.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The emulator as a process that can be stopped and started again on the same port (a storage outage). With a
    `data_dir` its objects are kept on disk there and survive a restart; without, they are in memory."""

    def __init__(self, bucket: str, log: Path, data_dir: Path | None = None, port: int = 0):
        self.bucket, self.log, self.data_dir = bucket, log, data_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> str:
        """Start it and wait until it takes connections; returns its URL (the STORAGE_EMULATOR_HOST value)."""
        storing = [f"--data-dir={self.data_dir}"] if self.data_dir else []
        command = [sys.executable, "-c", LAUNCHER, *storing, "start", "--host=127.0.0.1", f"--port={self.port}",
                   *([] if self.data_dir else ["--in-memory"]), f"--default-bucket={self.bucket}"]
        with open(self.log, "a", encoding="utf-8") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while storage.check_reachable(self.url, timeout_s=1) is not None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gcp-storage-emulator did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        return self.url

    def stop(self) -> None:
        """Kill it (connections are refused from now on); the objects on disk stay."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m maxpar.tools.emulator", description=(
        "A GCS JSON-API server on loopback (gcp-storage-emulator, with the object generation headers TensorStore's "
        "checkpoints need), until Ctrl-C."))
    parser.add_argument("--port", type=int, default=9023, help="port on 127.0.0.1 (0 = a free one)")
    parser.add_argument("--bucket", default="my-bucket", help="the bucket it starts with")
    parser.add_argument("--data_dir", type=Path, help="keep the objects on disk there (default: in memory)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        print("maxpar.tools.emulator: gcp-storage-emulator is not installed: bash install.sh test (or pip install "
              "gcp-storage-emulator)", file=sys.stderr)
        return 1
    log = logs.tool_log_path("emulator")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("", encoding="utf-8")
    server = Server(args.bucket, log, args.data_dir, args.port)
    try:
        url = server.start()
    except (RuntimeError, OSError) as e:
        print(f"maxpar.tools.emulator: {e}", file=sys.stderr)
        return 1
    where = f"objects in {args.data_dir}" if args.data_dir else "objects in memory"
    print(f"maxpar: GCS emulator on {url}, bucket {args.bucket} ({where}; its log: {log}). In the shells that use "
          f"it:\n  export {storage.EMULATOR}={url}\nthen gs://{args.bucket}/... paths reach it, e.g. "
          f"base_output_directory=gs://{args.bucket}/runs. Ctrl-C stops it.", flush=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # `kill PID` stops the server too
    # Ctrl-C stops it even where it started with SIGINT ignored (a script's background job inherits that)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status = server.process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
    print(f"maxpar.tools.emulator: the server exited with status {status}; see {log}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

