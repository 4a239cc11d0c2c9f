"""What a failed vLLM process's log says about why, for a test's failure message.

vLLM runs the model in background processes (``EngineCore``, ``Worker``): when one fails to
start, its own exception is logged by that process (a traceback, every line prefixed with
``(Worker pid=N) ERROR ...``) long before the front process's last words ("WorkerProc
initialization failed due to an exception in a background process", "Engine core
initialization failed. See root cause above").  A tail of the log keeps the last words and
loses the cause; :func:`failure_excerpt` keeps every traceback and error line, then the tail.
"""

from __future__ import annotations

import re
from typing import Final

#: The prefix vLLM puts on a background process's lines: "(Worker pid=7) ERROR 12-05 13:04:23
#: [file.py:12] ", or "(EngineCore pid=7) " alone on lines it did not log itself.
_PREFIX: Final = re.compile(r"^(\([A-Za-z_]+[^)]*pid=\d+\) )?"
                            r"((DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \S+ \[[^\]]*\] ?)?")
_ERROR: Final = re.compile(r"\b(ERROR|CRITICAL)\b")


def _body(line: str) -> str:
    """``line`` without vLLM's process and level prefix."""
    return line[_PREFIX.match(line).end():]  # type: ignore[union-attr]  # always matches


def failure_excerpt(log: str, *, tail: int = 3000, limit: int = 24000) -> str:
    """Every traceback of ``log`` (whichever process wrote it) and every ERROR line, in
    order and each once, at most ``limit`` characters of them; then the last ``tail``."""
    keep: list[str] = []
    seen: set[str] = set()
    in_traceback = False
    for line in log.splitlines():
        body = _body(line)
        if body.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and body and not body[0].isspace():
            # The exception line ends the traceback (a chained one starts another).
            keep.append(line)
            in_traceback = False
            continue
        if (in_traceback or _ERROR.search(line)) and (line not in seen or in_traceback):
            seen.add(line)
            keep.append(line)
    causes = "\n".join(keep)
    if len(causes) > limit:
        causes = causes[:limit // 2] + "\n[...]\n" + causes[-limit // 2:]
    return (f"--- tracebacks and errors in the log ---\n{causes or '(none)'}\n"
            f"--- the log's last {tail} characters ---\n{log[-tail:]}")
