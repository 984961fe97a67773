"""A load generator that is not the limit: `wrk` (C, one event loop per thread; Debian's `wrk`
package) sends a prepared list of requests, so the server's rate is measured rather than the
Python client's (on 2 cores, httpx costs 3-4 ms of CPU per request, more than the service).

Each of `clients` wrk threads owns one connection and sends requests k, k + clients, k + 2 ·
clients, ... of the list, cycling, for `seconds`: a request list whose item k belongs to
environment session k % clients therefore steps each session from one connection only."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

Request = tuple[str, str, bytes, dict[str, str]]  # method, path, body, headers

SCRIPT = r"""
local manifest = "%(manifest)s"
local clients = %(clients)d
local counter = 0

function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
end

function init(args)
  requests = {}
  local index = 0
  for line in io.lines(manifest) do
    if index %% clients == id then
      local method, path, file, headers = line:match("^(%%S+)\t(%%S+)\t(%%S+)\t(.*)$")
      local handle = io.open(file, "rb")
      local body = handle:read("*a")
      handle:close()
      local table_ = {}
      for name, value in headers:gmatch("([^\t:]+): ([^\t]+)") do table_[name] = value end
      requests[#requests + 1] = wrk.format(method, path, table_, body)
    end
    index = index + 1
  end
  position = 0
end

function request()
  position = position %% #requests + 1
  return requests[position]
end

function done(summary, latency, _requests)
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %%d, "microseconds": %%d, "non_2xx": %%d, "socket_errors": %%d, '
      .. '"p50_us": %%d, "p99_us": %%d}\n',
    summary.requests, summary.duration, errors.status,
    errors.connect + errors.read + errors.write + errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def available() -> bool:
    return shutil.which("wrk") is not None


def run(url: str, requests: list[Request], clients: int, seconds: float) -> dict[str, Any]:
    """Send `requests` (cycling) from `clients` connections for `seconds`; wrk's count,
    duration and latency percentiles. Raises if any answer was not 2xx."""
    if len(requests) < clients:
        raise ValueError(f"{len(requests)} requests for {clients} connections")
    with tempfile.TemporaryDirectory(prefix="rlserve-wrk-") as tmp:
        folder = Path(tmp)
        lines = []
        for index, (method, path, body, headers) in enumerate(requests):
            file = folder / f"body-{index}"
            file.write_bytes(body)
            fields = "\t".join(f"{name}: {value}" for name, value in headers.items())
            lines.append(f"{method}\t{path}\t{file}\t{fields}")
        manifest = folder / "manifest.tsv"
        manifest.write_text("\n".join(lines) + "\n")
        script = folder / "load.lua"
        script.write_text(SCRIPT % {"manifest": manifest, "clients": clients})
        command = [
            "wrk",
            f"--threads={clients}",
            f"--connections={clients}",
            f"--duration={max(1, round(seconds))}s",
            "--timeout=600s",
            f"--script={script}",
            url,
        ]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    figures = json.loads(output.strip().splitlines()[-1])
    if figures["non_2xx"] or figures["socket_errors"]:
        raise RuntimeError(f"wrk saw failed requests: {figures}\n{output}")
    return figures
