"""How a child process ended, in words, and the part of its log that says why.

A process killed by a signal in C code (llama.cpp) writes nothing of its own:
its exit code is the only witness, so the message names the signal. Python's
fault handler (turned on by :func:`meshnode.logs.configure_logging`) leaves a
report of every thread's stack on stderr first; of that report the tail keeps
its first line and the stack of the thread that received the signal, since the
other threads' stacks push the lines that explain the crash out of a short tail.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path

# The first line of a faulthandler report, e.g. "Fatal Python error: Segmentation fault".
FATAL_ERROR_PREFIX = "Fatal Python error: "
# Headers of the stack of the thread the report is about (all threads, or only the current one).
_CRASHING_THREAD_PREFIXES = ("Current thread ", "Stack (most recent call first)")
# Lines a report is made of after its first (CPython 3.11 faulthandler): stack headers, indented
# frames, blank separators, the list of extension modules.
_REPORT_PREFIXES = (
    "  ",
    "Thread 0x",
    "Extension modules:",
    "Python runtime state:",
    *_CRASHING_THREAD_PREFIXES,
)
TAIL_LINES = 15
# Log lines kept before a fault report: what the process said just before the signal.
LINES_BEFORE_REPORT = 8


def describe_exit(returncode: int) -> str:
    """``died of SIGSEGV (signal 11)`` or ``exited with code 1`` (``Popen.returncode`` convention)."""
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            return f"died of signal {number}"
        return f"died of {name} (signal {number})"
    return f"exited with code {returncode}"


def log_tail(lines: Sequence[str], count: int = TAIL_LINES) -> list[str]:
    """The last ``count`` lines; if the log holds a fault report, the lines just before it, the
    report's first line and the crashing thread's stack instead."""
    start = _final_report(lines)
    if start is None:
        return list(lines[-count:])
    before = lines[max(0, start - LINES_BEFORE_REPORT) : start]
    return [*before, lines[start], *_crashing_thread(lines[start + 1 :])]


def _final_report(lines: Sequence[str]) -> int | None:
    """Where the report that ends the log starts. A log appended to by earlier runs may hold an old
    report; one followed by anything but report lines is not how this process ended."""
    for index in reversed(range(len(lines))):
        line = lines[index]
        if line.startswith(FATAL_ERROR_PREFIX):
            return index
        if line.strip() and not line.startswith(_REPORT_PREFIXES):
            return None
    return None


def _crashing_thread(report: Sequence[str]) -> list[str]:
    """The stack block (header and ``File`` lines) of the thread the signal hit, and a count of the
    stacks left out."""
    others = sum(line.startswith("Thread 0x") for line in report)
    for index, line in enumerate(report):
        if line.startswith(_CRASHING_THREAD_PREFIXES):
            block = [line]
            for frame in report[index + 1 :]:
                if not frame.strip():
                    break
                block.append(frame)
            if others:
                block.append(f"  ({others} more thread stack{'s' if others > 1 else ''} in the log)")
            return block
    # No stack header (a report cut short): whatever followed the first line.
    return list(report[:TAIL_LINES])


def read_log_tail(path: Path, count: int = TAIL_LINES, indent: str = "    ") -> str:
    """:func:`log_tail` of the file at ``path``, indented; empty if it cannot be read."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(indent + line for line in log_tail(lines, count))


def exit_message(name: str, returncode: int, log: Path, what: str | None = None) -> str:
    """``B died of SIGSEGV (signal 11) while serving; the end of /x/B.log:`` and the tail."""
    during = f" while {what}" if what else ""
    tail = read_log_tail(log)
    where = f"the end of {log}:\n{tail}" if tail else f"{log} is empty"
    return f"{name} {describe_exit(returncode)}{during}; {where}"


__all__ = ["FATAL_ERROR_PREFIX", "describe_exit", "exit_message", "log_tail", "read_log_tail"]
