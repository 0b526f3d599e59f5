"""A process's memory as /proc tells it, in MB: resident now (anonymous and file-backed) and its peak."""

from __future__ import annotations

import re
from pathlib import Path


def memory_mb(pid: int | str = "self") -> dict[str, float]:
    fields = dict(re.findall(r"(VmRSS|VmHWM|RssAnon|RssFile):\s+(\d+)", Path(f"/proc/{pid}/status").read_text()))
    return {"rss": int(fields["VmRSS"]) / 1024, "anonymous": int(fields["RssAnon"]) / 1024,
            "file": int(fields["RssFile"]) / 1024, "peak": int(fields["VmHWM"]) / 1024}
