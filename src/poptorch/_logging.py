"""PopTorch's logger: ``poptorch.logger``, ``setLogLevel`` and ``POPTORCH_LOG_LEVEL``.

Messages go to the ``poptorch::python`` logger. They are printed on stderr as
``[poptorch] LEVEL: message`` (as PopTorch does) and also propagate to the application's
handlers; when one of those already prints on the console (a root ``StreamHandler`` on
stderr or stdout, as ``logging.basicConfig()`` installs), ours stays silent so that
nothing is printed twice. Handlers that only collect records (files, memory, pytest's
capture) do not silence the console.

Levels are PopTorch's: OFF, ERR, WARN, INFO (the default), DEBUG, TRACE and TRACE_ALL.
``Options.logDir`` adds a log file and ``Options.maxRepeatLogs`` limits repeated lines;
both take effect when a model is compiled with those options (see
:py:func:`apply_options`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ._typing import OptionsView

__all__ = [
    "LOG_FILE_NAME",
    "TRACE",
    "TRACE_ALL",
    "apply_options",
    "describe_error",
    "info_once",
    "log_once",
    "logger",
    "setLogLevel",
]

TRACE = 5
TRACE_ALL = 1
logging.addLevelName(TRACE, "TRACE")
logging.addLevelName(TRACE_ALL, "TRACE_ALL")
_OFF = logging.CRITICAL + 10
# set on the records log_once emits: the repeat filter lets them through
_ONCE_ATTR = "_poptorch_once"

_LEVELS = {
    "OFF": _OFF,
    "ERR": logging.ERROR,
    "ERROR": logging.ERROR,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "INFO": logging.INFO,
    "DEBUG": logging.DEBUG,
    "TRACE": TRACE,
    "TRACE_ALL": TRACE_ALL,
}
_DOCUMENTED_LEVELS = "OFF, ERR, WARN, INFO, DEBUG, TRACE, TRACE_ALL"
# setLogLevel(int): PopTorch's integer levels.
_POPTORCH_INTS = {0: "TRACE", 1: "DEBUG", 2: "INFO", 3: "WARN", 4: "ERR", 6: "OFF"}

LOG_FILE_NAME = "poptorch.log"
"""Name of the file written in ``Options.logDir(dir)``."""

logger = logging.getLogger("poptorch::python")


def _application_prints_on_console() -> bool:
    """True if a root handler already writes records to stderr or stdout."""
    consoles = {id(stream) for stream in (sys.stderr, sys.stdout, sys.__stderr__,
                                          sys.__stdout__) if stream is not None}
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            continue
        if isinstance(handler, logging.StreamHandler) and \
                id(getattr(handler, "stream", None)) in consoles:
            return True
    return False


class _StderrUnlessConfigured(logging.StreamHandler):
    """Prints on stderr unless the application's own handlers already print on the
    console (then the record reaches the console through them, once)."""

    @property
    def stream(self) -> TextIO:  # resolved at every write so that redirected stderr is honoured
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if _application_prints_on_console():
            return  # the record propagates to the application's console handler instead
        super().emit(record)


class _RepeatFilter(logging.Filter):
    """Suppresses a message repeated more than ``max_repeats`` times in a row, then
    reports how many were suppressed when a different message arrives."""

    def __init__(self, max_repeats: int | None) -> None:
        super().__init__()
        self.max_repeats = max_repeats
        self._last: tuple[int, str] | None = None
        self._count = 0
        self._suppressed = 0
        self._lock = threading.RLock()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_poptorch_summary", False):
            return True
        if getattr(record, _ONCE_ATTR, False):
            # a log_once message is printed once per thing it is about (a model, an
            # option...): the same text for another thing is news, not a repeated line
            return True
        with self._lock:
            key = (record.levelno, record.getMessage())
            if key == self._last:
                self._count += 1
                if self.max_repeats is not None and self._count > self.max_repeats:
                    self._suppressed += 1
                    return False
                return True
            self._flush_summary()
            self._last, self._count = key, 1
            return True

    def _flush_summary(self) -> None:
        if self._suppressed and self._last is not None:
            summary = logger.makeRecord(
                logger.name, self._last[0], __file__, 0,
                "... last message repeated %d more times (suppressed, see "
                "Options.maxRepeatLogs)", (self._suppressed,), None)
            summary._poptorch_summary = True
            self._suppressed = 0
            logger.handle(summary)


_stderr_handler = _StderrUnlessConfigured()
_stderr_handler.setFormatter(logging.Formatter("[poptorch] %(levelname)s: %(message)s"))
logger.addHandler(_stderr_handler)
_repeat_filter = _RepeatFilter(4)
logger.addFilter(_repeat_filter)
_file_handler: logging.FileHandler | None = None
_once_keys: set = set()
_once_lock = threading.Lock()


def _parse_level(level: object, source: str) -> int:
    if isinstance(level, bool):
        raise ValueError(f"{source}: invalid log level {level!r}; use one of "
                         f"{_DOCUMENTED_LEVELS} or a logging level number.")
    if isinstance(level, int):
        # PopTorch's legacy integers 0-4 and 6, or a logging level number (>= 10).
        if level in _POPTORCH_INTS:
            return _LEVELS[_POPTORCH_INTS[level]]
        if level < 10:
            raise ValueError(f"{source}: Invalid log level integer {level}: use PopTorch's "
                             f"0 (TRACE), 1 (DEBUG), 2 (INFO), 3 (WARN), 4 (ERR), 6 (OFF) "
                             f"or a logging level number >= 10.")
        return level
    if isinstance(level, str):
        name = level.strip().upper()
        if name in _LEVELS:
            return _LEVELS[name]
        if name.isdigit():
            return _parse_level(int(name), source)
    raise ValueError(f"{source}: Unknown log level: {level}. Valid values are DEBUG, ERR, "
                     f"INFO, OFF, TRACE and WARN (any case; also {_DOCUMENTED_LEVELS}, or "
                     f"a logging level number >= 10).")


def setLogLevel(level: str | int) -> None:
    """Set how much PopTorch logs.

    Args:
        level: OFF, ERR, WARN, INFO, DEBUG, TRACE or TRACE_ALL (any case), or a
            ``logging`` level number such as ``logging.DEBUG``.
    """
    logger.setLevel(_parse_level(level, "setLogLevel"))


def log_once(level: int, key: Hashable, msg: str, *args: object) -> bool:
    """Log ``msg`` at ``level`` only the first time ``key`` is seen in this process.

    Returns True if the message was logged (or would have been, given the level).
    """
    with _once_lock:
        if key in _once_keys:
            return False
        _once_keys.add(key)
    logger.log(level, msg, *args, extra={_ONCE_ATTR: True})
    return True


def info_once(key: Hashable, msg: str, *args: object) -> bool:
    """Log ``msg`` at INFO only the first time ``key`` is seen in this process."""
    return log_once(logging.INFO, key, msg, *args)


def describe_error(error: BaseException) -> str:
    """``Type: first line of its message``: how a log line names an exception."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def set_max_repeat_logs(max_lines: int | None) -> None:
    """Suppress a message repeated more than ``max_lines`` times in a row (None: never)."""
    _repeat_filter.max_repeats = max_lines


def set_log_dir(log_dir: str | None) -> str | None:
    """Also write every log record to ``<log_dir>/poptorch.log`` (None: stop).

    Returns the path of the log file.
    """
    global _file_handler
    if _file_handler is not None:
        logger.removeHandler(_file_handler)
        _file_handler.close()
        _file_handler = None
    if log_dir is None:
        return None
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, LOG_FILE_NAME)
    _file_handler = logging.FileHandler(path)
    _file_handler.setFormatter(logging.Formatter(
        "%(asctime)s [poptorch] %(levelname)s: %(message)s"))
    logger.addHandler(_file_handler)
    return path


def apply_options(options: OptionsView) -> None:
    """Apply the logging options of ``options`` (``maxRepeatLogs``, ``logDir``).

    Called when a model is compiled with ``options``. The log file is only opened when
    ``logDir`` was called explicitly, so that programs do not litter the working
    directory with log files by default.
    """
    set_max_repeat_logs(options.max_repeat_logs)
    if options._log_dir_set:
        set_log_dir(options.log_dir)


def _read_env_level() -> None:
    value = os.environ.get("POPTORCH_LOG_LEVEL")
    if value is None:
        logger.setLevel(logging.INFO)
        return
    logger.setLevel(_parse_level(value, "POPTORCH_LOG_LEVEL environment variable"))


_read_env_level()


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Silence another library's logger ``name`` for a while (a failed attempt of ours
    whose report the user should not see: we say why in one line of our own)."""
    other = logging.getLogger(name)
    level = other.level
    other.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        other.setLevel(level)
