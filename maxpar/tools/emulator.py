"""gcp-storage-emulator (the `test` extra) as a GCS JSON-API server on loopback that TensorStore can use, which can be
stopped and started again on the same port: for the tests (tests/gcs.py) and the checkpoint benchmark's bucket tier."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from maxpar.core import storage

# The emulator as a server TensorStore can use: its media downloads lack the `x-goog-generation` header that GCS sends
# and TensorStore's OCDBT reads ("Malformed StorageGeneration" otherwise), so the launcher adds it.
LAUNCHER = """
import sys
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

    def __init__(self, bucket: str, log: Path, data_dir: Path | None = None):
        self.bucket, self.log, self.data_dir = bucket, log, data_dir
        self.port = free_port()
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
