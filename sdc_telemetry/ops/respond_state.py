"""The responder's state file (``--state``): the hosts acted on and the start times of recent actions, so that a
restart neither acts on a host again within ``reacquire_after_s`` nor forgets the hourly cap.

The file is JSON, ``{"hosts": {host: {"at": time, ...}}, "actions": [time, ...]}``, written durably: a temp file,
fsync, atomic rename, fsync of the directory.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["read_state", "write_state"]

log = logging.getLogger("sdc_telemetry")


def read_state(path: Path) -> tuple[dict[str, dict[str, Any]], list[float]]:
    """(hosts acted on, action start times in order) from an existing state file; ValueError naming the file when it
    is unreadable or malformed."""
    try:
        doc = json.loads(path.read_text())
        hosts, actions = doc["hosts"], doc["actions"]
        if not isinstance(hosts, dict) or not isinstance(actions, list) \
                or not all(isinstance(t, (int, float)) for t in actions) \
                or not all(isinstance(v, dict) and isinstance(v.get("at"), (int, float)) for v in hosts.values()):
            raise TypeError("'hosts' must map host names to {'at': time, ...} and 'actions' be a list of times")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--state file {path} is unreadable or malformed: {e}") from None
    return {str(h): v for h, v in hosts.items()}, sorted(float(t) for t in actions)


def write_state(path: Path, hosts: dict[str, dict[str, Any]], actions: list[float]) -> None:
    """Write the state file durably: a temp file, fsync, atomic rename, fsync of the directory. A failure is logged,
    not raised (the process memory still holds the state; losing the file is not worth a crash)."""
    doc = {"hosts": hosts, "actions": actions}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:  # the process memory still holds the state; losing the file is not worth a crash
        log.error("sdc responder: could not write --state file %s: %s", path, e)
