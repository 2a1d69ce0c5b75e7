"""A run's console: sluice's lines and any library's errors on the terminal; Ray's and libraries'
records, Python warnings and native writes to fd 2 in ``run.log``, kept."""

import logging
import os
import sys
import warnings

from sluice.telemetry.console import RUN_LOG, run_console


def test_the_terminal_gets_sluices_lines_and_errors_and_the_log_keeps_everything(tmp_path, capfd):
    before = logging.getLogger().handlers[:]
    ray_logger = logging.getLogger("ray")  # as ensure_ray leaves it (a test's own ray.init may configure it)
    ray_state = (ray_logger.propagate, ray_logger.level, ray_logger.handlers[:])
    ray_logger.propagate, ray_logger.level, ray_logger.handlers = True, logging.NOTSET, []
    assert not logging.getLogger("sluice.rl_trainer").isEnabledFor(logging.INFO)  # cached, as in a long process
    with run_console(tmp_path) as terminal:
        logging.getLogger("sluice.rl_trainer").warning("sluice says this")
        logging.getLogger("sluice.rl_trainer").info("sluice's detail")
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
        logging.getLogger("ray").warning("Token authentication is enabled")
        logging.getLogger("urllib3.connectionpool").error("a library's error")
        with warnings.catch_warnings():  # whatever filters earlier tests in this process left
            warnings.simplefilter("always")
            warnings.warn("`past_key_values` is deprecated", FutureWarning, stacklevel=1)
        os.write(2, b"[E core_worker.cc:2465] max_restarts > 0\n")  # what native code writes
        print("stopped: one line of sluice's", file=terminal)
        print("a library's own handler or progress bar", file=sys.stderr)
    path = tmp_path / RUN_LOG
    terminal = capfd.readouterr().err  # what the user saw
    assert "sluice says this" in terminal and "a library's error" in terminal and "stopped: one line" in terminal
    noises = ("Started a local Ray", "Token authentication", "past_key_values", "core_worker.cc", "detail", "own hand")
    for noise in noises:
        assert noise not in terminal, noise
    log = path.read_text()
    for kept in ("sluice says this", "sluice's detail", "Started a local Ray instance.", "Token authentication",
                 "a library's error", "FutureWarning: `past_key_values`", "core_worker.cc:2465",
                 "a library's own handler"):  # fmt: skip
        assert kept in log, kept
    ray_logger.propagate, ray_logger.level, ray_logger.handlers = ray_state
    assert logging.getLogger().handlers == before  # put back
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"
