"""A real Prometheus over a TSDB written by `promtool tsdb create-blocks-from openmetrics`."""

import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


def gpu_memory(readings: dict[tuple[str, str], tuple[int, int, range]]) -> str:
    """Triton's GPU memory series in OpenMetrics, for `backfilled_prometheus`: for each (node,
    GPU uuid) of pool `gpu`, its bytes in use and in all at each second of its range."""
    lines = []
    for name in ("nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"):
        lines += [f"# HELP {name} GPU memory, in bytes", f"# TYPE {name} gauge"]
        for (node, uuid), (used, total, times) in readings.items():
            value = used if name.endswith("used_bytes") else total
            lines += [
                f'{name}{{gpu_uuid="{uuid}",node="{node}",pool="gpu"}} {value} {t}' for t in times
            ]
    return "\n".join(lines) + "\n# EOF\n"


@contextmanager
def backfilled_prometheus(root: Path, openmetrics: str | Iterable[str]) -> Iterator[str]:
    """Yields the URL of a Prometheus that holds exactly `openmetrics` (ending with `# EOF`),
    given whole or as lines (streamed to disk: a fleet's series do not fit a string well)."""
    with (root / "input.om").open("w") as written:
        written.writelines([openmetrics] if isinstance(openmetrics, str) else openmetrics)
    data = root / "data"
    promtool = shutil.which("promtool") or "promtool"
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(root / "input.om"), str(data)],
        check=True,
        capture_output=True,
    )
    (root / "prometheus.yml").write_text("global: {scrape_interval: 15s}\nscrape_configs: []\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1):  # noqa: S310 - localhost
                    break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(20)
