"""A real ``specflow serve`` subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from omegaconf import OmegaConf
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_serve_config(path: Path, name: str, limits: dict | None = None, **engine) -> Path:
    """A serve YAML for model id ``name`` on CPU; ``limits`` holds RequestLimits fields (default:
    none), ``engine`` the EngineConfig fields."""
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"name": name, "limits": limits or {}, "engine": {"device": "cpu", "dtype": "float32", **engine}}
    OmegaConf.save(OmegaConf.create(config), path)
    return path


class ServerProcess:
    """``python -m specflow.cli serve CONFIG --port P ARGS``; ``wait_ready`` polls ``/health``."""

    def __init__(self, config: Path, *args: str, threads: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="specflow-serve-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specflow.cli", "serve", str(config), "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        """Block until ``/health`` answers 200 (the engine is loaded and its thread runs)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log}")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120.0) -> int:
        """Send ``sig`` and wait for the exit status (killing it if it hangs past ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metric(self, name: str, **labels: str) -> float:
        """The current value of one sample of ``/metrics`` (0 when the series does not exist yet)."""
        text = httpx.get(self.url + "/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0

    @property
    def log(self) -> str:
        return Path(self._log.name).read_text()
