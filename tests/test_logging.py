"""poptorch.logger, setLogLevel, POPTORCH_LOG_LEVEL, logDir, maxRepeatLogs, log-once."""
import io
import logging
import os
import subprocess
import sys

import pytest
import torch

import poptorch
from poptorch import _logging


@pytest.fixture(autouse=True)
def _restore_logging():
    level = poptorch.logger.level
    yield
    poptorch.logger.setLevel(level)
    _logging.set_max_repeat_logs(4)
    _logging.set_log_dir(None)


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "poptorch::python"]


def test_logger_name_matches_upstream():
    assert poptorch.logger is logging.getLogger("poptorch::python")


@pytest.mark.parametrize("name,level", [
    ("OFF", logging.CRITICAL + 10), ("ERR", logging.ERROR), ("err", logging.ERROR),
    ("WARN", logging.WARNING), ("Info", logging.INFO), ("DEBUG", logging.DEBUG),
    ("TRACE", 5), ("trace_all", 1), (logging.DEBUG, logging.DEBUG), (15, 15),
    ("WARNING", logging.WARNING),
])
def test_set_log_level(name, level):
    poptorch.setLogLevel(name)
    assert poptorch.logger.level == level


@pytest.mark.parametrize("bad", ["LOUD", "", None, -1, True, 2.5, 5, 9])
def test_bad_log_level_raises(bad):
    with pytest.raises(ValueError, match="Unknown log level|Invalid log level integer"
                                         "|OFF, ERR, WARN, INFO, DEBUG, TRACE, TRACE_ALL"):
        poptorch.setLogLevel(bad)


@pytest.mark.parametrize("legacy,name", [(0, "TRACE"), (1, "DEBUG"), (2, "INFO"),
                                         (3, "WARN"), (4, "ERR"), (6, "OFF")])
def test_poptorch_integer_levels(legacy, name):
    poptorch.setLogLevel(legacy)
    by_int = poptorch.logger.level
    poptorch.setLogLevel(name)
    assert by_int == poptorch.logger.level


def test_levels_filter_messages(caplog):
    caplog.set_level(1, logger="poptorch::python")
    poptorch.setLogLevel("WARN")
    poptorch.logger.info("hidden info")
    poptorch.logger.warning("shown warning")
    poptorch.setLogLevel("TRACE")
    poptorch.logger.log(_logging.TRACE, "shown trace")
    poptorch.logger.log(_logging.TRACE_ALL, "hidden trace_all")
    poptorch.setLogLevel("OFF")
    poptorch.logger.error("hidden error")
    assert _messages(caplog) == ["shown warning", "shown trace"]


def test_env_var_read_at_import(monkeypatch):
    monkeypatch.setenv("POPTORCH_LOG_LEVEL", "debug")
    _logging._read_env_level()
    assert poptorch.logger.level == logging.DEBUG
    monkeypatch.delenv("POPTORCH_LOG_LEVEL")
    _logging._read_env_level()
    assert poptorch.logger.level == logging.INFO  # the documented default
    monkeypatch.setenv("POPTORCH_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="POPTORCH_LOG_LEVEL"):
        _logging._read_env_level()


def test_env_var_in_a_fresh_process():
    env = dict(os.environ, POPTORCH_LOG_LEVEL="TRACE")
    out = subprocess.run([sys.executable, "-c", "import poptorch; print(poptorch.logger.level)"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "5"


def test_stderr_format_when_application_has_no_logging(monkeypatch, capsys):
    monkeypatch.setattr(logging.root, "handlers", [])
    poptorch.setLogLevel("INFO")
    poptorch.logger.info("hello %d", 3)
    assert capsys.readouterr().err == "[poptorch] INFO: hello 3\n"


def test_no_duplicate_when_application_prints_on_console(monkeypatch, capsys, caplog):
    caplog.set_level(logging.INFO, logger="poptorch::python")
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("app: %(message)s"))
    monkeypatch.setattr(logging.root, "handlers", [console])
    poptorch.setLogLevel("INFO")
    poptorch.logger.info("once only")
    assert capsys.readouterr().err == "app: once only\n"  # the application's handler


def test_collecting_handlers_do_not_silence_stderr(monkeypatch, capsys):
    collected = io.StringIO()
    monkeypatch.setattr(logging.root, "handlers", [logging.StreamHandler(collected)])
    poptorch.setLogLevel("WARN")
    poptorch.logger.warning("visible %s", "twice")
    assert capsys.readouterr().err == "[poptorch] WARNING: visible twice\n"
    assert collected.getvalue() == "visible twice\n"  # and propagated to the application


def test_max_repeat_logs_suppresses_and_reports(caplog):
    caplog.set_level(logging.INFO, logger="poptorch::python")
    poptorch.setLogLevel("INFO")
    opts = poptorch.Options().maxRepeatLogs(2)
    opts._apply_effects()  # what a model compiled with these options does
    poptorch.logger.info("start")
    for _ in range(5):
        poptorch.logger.info("same")
    poptorch.logger.info("different")
    assert _messages(caplog) == [
        "start", "same", "same",
        "... last message repeated 3 more times (suppressed, see Options.maxRepeatLogs)",
        "different"]


def test_max_repeat_logs_none_shows_everything(caplog):
    caplog.set_level(logging.INFO, logger="poptorch::python")
    poptorch.setLogLevel("INFO")
    _logging.set_max_repeat_logs(None)
    poptorch.logger.info("start none")
    for _ in range(6):
        poptorch.logger.info("again")
    assert _messages(caplog).count("again") == 6


def test_once_per_model_warning_is_not_a_repeated_line(capfd):
    """A log_once message (here: an input that requires grad, once per model) is printed
    for every model, however many models in a row give it: the repeat limit is for one
    source repeating itself, not for the same news about six different models."""
    poptorch.setLogLevel("WARN")
    text = "Input tensor has requires_grad=True set"
    torch.manual_seed(0)
    for _ in range(6):
        layer = torch.nn.Linear(2, 2)
        x = torch.randn(3, 2, requires_grad=True)
        expected = layer(x.detach())
        out = poptorch.inferenceModel(layer)(x)
        torch.testing.assert_close(out, expected)
        assert not out.requires_grad  # detached, as the message says
        out_err = capfd.readouterr()
        assert (out_err.out + out_err.err).count(text) == 1
    poptorch.logger.warning("plain line")
    for _ in range(5):
        poptorch.logger.warning("plain line")
    assert capfd.readouterr().err.count("plain line") == 4  # the limit still holds


def test_log_dir_writes_a_log_file(tmp_path):
    poptorch.setLogLevel("INFO")
    log_dir = tmp_path / "logs"
    opts = poptorch.Options().logDir(str(log_dir))
    opts._freeze()  # freezing alone has no effect ...
    assert not log_dir.exists()
    model = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x), model(x))
    assert log_dir.exists()  # ... the options take effect when the model compiles
    poptorch.logger.warning("into the file")
    _logging.set_log_dir(None)  # closes the file
    text = (log_dir / _logging.LOG_FILE_NAME).read_text()
    assert "[poptorch] WARNING: into the file" in text


def test_default_log_dir_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    poptorch.Options()._apply_effects()
    poptorch.logger.warning("not in a file")
    assert not (tmp_path / _logging.LOG_FILE_NAME).exists()


def test_info_once(caplog):
    caplog.set_level(logging.INFO, logger="poptorch::python")
    poptorch.setLogLevel("INFO")
    assert _logging.info_once(("test_info_once", 1), "first %s", "time")
    assert not _logging.info_once(("test_info_once", 1), "first %s", "time")
    assert _logging.log_once(logging.WARNING, ("test_info_once", 2), "other")
    assert _messages(caplog) == ["first time", "other"]
