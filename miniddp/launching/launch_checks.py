"""What ``miniddp config`` and ``miniddp launch`` both check: whole numbers and their bounds, host names, the
place a config file is written, a value shown in an error line.

What
    ``whole_number(text, low, high)`` reads ASCII digits only. ``host(text)`` takes an IP address or
    an ASCII host name. ``MAX_PROCESSES`` and ``MAX_PER_MACHINE`` bound the process counts: torch
    numbers ranks with C ``int`` (so a job has at most 2**31 - 1 processes), and Linux runs at most
    ``PID_MAX_LIMIT`` = 2**22 processes (and threads) on one machine, whatever its ``pid_max``.
    ``unwritable(path)`` says why a config cannot be written at ``path``, before any question is
    asked. ``shown(value)`` is a YAML value in an error line, one short line whatever the value.
    ``cpu_cores()`` is what an oversubscribed CPU job is measured against. ``OneLineParser``: a bad
    flag of ``miniddp config`` or ``env`` is one line, status 2, without argparse's usage.

Why
    Python's ``int`` also reads Arabic-Indic digits (``int('٢') == 2``), so a pasted answer passed
    as a number; nothing bounded the counts, so 99999999999999999999 machines were written and
    launched; a host name with a byte that is not ASCII ended in torchrun's 31-line ``ValueError``
    when the rendezvous began; a directory or a path under a file as the output ended in a
    traceback after every question had been answered, and the answers were lost.

How torch and Accelerate differ
    ``accelerate config`` converts answers with ``int`` and opens the file at the end, as this
    code did. torchrun takes ``--nnodes`` and ``--nproc-per-node`` as any ``int`` and checks a
    host only as its rendezvous starts (``parse_rendezvous_endpoint``, which accepts any Unicode
    word character).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re

MAX_PROCESSES = 2**31 - 1  # ranks and the world size are C ints in c10d (ProcessGroup::getSize)
MAX_PER_MACHINE = 2**22  # Linux's PID_MAX_LIMIT on 64 bits: the most processes one machine can hold at once
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")  # RFC 1123, and `_` as torchrun allows


def whole_number(text: str, low: int, high: int) -> int:
    """``text`` as an int in ``low..high``; ASCII digits only (``int`` also takes '٢' and ' 7 ')."""
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{text!r} is not a whole number written in the digits 0-9")
    value = int(text)
    if not low <= value <= high:
        raise ValueError(f"{value} is not in {low}..{high}")
    return value


def host(text) -> str:
    """``text`` if it is an IP address or an ASCII host name (labels of letters, digits, ``-`` and ``_``)."""
    # `%` starts an IPv6 zone (fe80::1%eth0), which torchrun's rendezvous parser refuses
    if isinstance(text, str) and text.isascii() and 0 < len(text) <= 253 and "%" not in text:
        try:
            ipaddress.ip_address(text)
            return text
        except ValueError:
            labels = text.split(".")
            # all digits (1.2.3.400) is a mistyped address, which a name lookup would only fail on later
            if all(_LABEL.fullmatch(label) for label in labels) and not all(label.isdigit() for label in labels):
                return text
    raise ValueError("must be an IP address (e.g. 10.0.0.1) or an ASCII host name (e.g. node01.cluster)")


def shown(value, limit: int = 80) -> str:
    """``value`` as JSON for an error line (a date or bytes as their text), cut at ``limit`` characters."""
    text = json.dumps(value, default=str, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit] + "..."


def unwritable(path: str) -> str | None:
    """Why no config can be written at ``path`` (the caller adds the fix), or None. The folders it needs are
    made now, as writing would make them: a place where they cannot be (under a file, a read-only or special
    file system) is found before the questions rather than after them."""
    if not path:
        return "is empty"
    if os.path.isdir(path):
        return "is a directory, not a file"
    if os.path.lexists(path) and not os.path.isfile(path):
        return "exists and is not a regular file (a device, a pipe or a broken link)"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        above = folder
        while not os.path.lexists(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            return f"{above} is a file, not a folder"
        return f"cannot make the folder {folder} ({err.strerror})"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file is not writable"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable"
    return None


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or ``taskset``'s share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints the usage too; one line and status 2 are enough
        self.exit(2, f"{self.prog}: error: {message}\n")
