"""The ``sparkv`` command line as a user meets it: every flag has help text and a stated default,
docs/cli.md is what the parsers generate, and every expected failure is one line on stderr with
exit status 2 (never a traceback), found before anything slow starts."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from sparkv import clidoc
from sparkv.cli import HelpFormatter, build_parser, main, walk_parsers

NO_SERVER = "http://127.0.0.1:9"        # the discard port: nothing listens there
CID = "a" * 32


def _actions():
    for path, p in walk_parsers(build_parser()):
        for a in p._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                yield " ".join(path), a


def test_every_argument_has_help_text():
    missing = [f"{cmd} {a.option_strings or a.dest}" for cmd, a in _actions() if not a.help]
    assert not missing, missing


def test_help_states_defaults_and_hides_secrets(monkeypatch):
    monkeypatch.setenv("SPARKV_API_KEY", "sk-secret-123")
    monkeypatch.setenv("SPARKV_SSL_KEYFILE_PASSWORD", "hunter2")
    commands = dict(walk_parsers(build_parser()))
    for p in commands.values():
        assert p.formatter_class is HelpFormatter
    ask = commands[("sparkv", "ask")].format_help()
    assert "(default: 64)" in ask and "(default: sparkv)" in ask
    assert "sk-secret-123" not in ask
    assert "hunter2" not in commands[("sparkv", "serve")].format_help()
    serve = commands[("sparkv", "device", "serve")].format_help()
    assert "see --help" not in serve and "SPARKV_DEVICE_SOCKET" in serve


def test_docs_cli_md_is_generated_from_the_parsers():
    assert clidoc.DOC_PATH.read_text() == clidoc.render(), \
        "docs/cli.md is stale: run python -m sparkv.clidoc"
    assert clidoc.main(["--check"]) == 0


def test_clidoc_check_fails_on_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text(clidoc.render().replace("--max-new-tokens", "--max-tokens"))
    assert clidoc.main(["--check", "--out", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err


def _fails(argv: list[str], capsys, what: str) -> str:
    """Runs ``sparkv argv``: exit 2, one line on stderr naming ``what``, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("sparkv: error:") and what in err, err
    return err


@pytest.fixture
def no_model(monkeypatch):
    """Any model load or server connection fails the test: the error must come first."""
    from sparkv.edge.session import EdgeSession

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the argument error")

    monkeypatch.setattr(EdgeSession, "connect", refuse)
    monkeypatch.setattr("sparkv.runtime.load_model", refuse)


def test_ask_argument_errors_come_before_the_model(no_model, capsys, tmp_path):
    ask = ["ask", "--server", NO_SERVER, "--context", CID, "q"]
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "string", '
                      '"pattern": "(?=x)"}}}')
    _fails(ask + ["--trace", "3g"], capsys, "'3g' is neither a bundled trace")
    _fails(ask + ["--decode-budget", "0.25"], capsys, "--decode-budget needs --decode")
    _fails(ask + ["--press", "nope:0.5"], capsys, "unknown press")
    _fails(ask + ["--level", "q9"], capsys, "--level 'q9': choose auto or one of")
    _fails(ask + ["--decode", "nope"], capsys, "unknown decode policy 'nope'")
    _fails(ask + ["--temperature", "1", "--seed", str(1 << 70)], capsys, "seed must be")
    _fails(ask + ["--json-schema", str(schema)], capsys, "lookarounds")
    _fails(ask + ["--logit-bias", "5=1", "--logit-bias", "5=2"], capsys, "names a token twice")
    with pytest.raises(SystemExit) as e:                   # argparse: one link or the other
        main(ask + ["--trace", "lte", "--mbps", "20"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_an_unreachable_device_service_is_one_line(tmp_path, capsys):
    _fails(["device", "list", "--url", NO_SERVER], capsys, f"device service at {NO_SERVER} is "
                                                           "unreachable")
    _fails(["device", "stats", "--socket", str(tmp_path / "none.sock")], capsys, "unreachable")


def test_the_kept_note_says_where_the_answer_came_from():
    from types import SimpleNamespace as NS

    from sparkv.edge.commands import kept_note

    bd = NS(strategy="kept", chunks_streamed=3, bytes_streamed=360_000, chunks_computed=1)
    note = kept_note(NS(kept_id="abc", breakdown=bd))
    assert note.startswith("answered from the kept context abc")
    assert "3 chunks restored from the server (0.36 MB), 1 recomputed" in note
    first = kept_note(NS(kept_id="abc", breakdown=NS(strategy="sparkv")))
    assert first.startswith("kept as context abc")


def test_a_401_names_the_flag_not_only_the_header():
    from sparkv.edge.commands import api_key_hint
    from sparkv.errors import SparkvError
    from sparkv.protocol.errors import ApiError

    with pytest.raises(SparkvError) as e, api_key_hint():
        raise ApiError(401, "missing_api_key", "send 'Authorization: Bearer <key>'")
    assert "--api-key" in str(e.value) and "SPARKV_API_KEY" in str(e.value)
    with pytest.raises(SparkvError) as e, api_key_hint():
        raise ApiError(403, "forbidden", "not this one")
    assert "403" in str(e.value) and "--api-key" in str(e.value)
    with pytest.raises(ApiError), api_key_hint():        # other errors pass unchanged
        raise ApiError(404, "context_not_found", "no context")


def test_context_commands_name_the_key_flag_on_a_401(monkeypatch, capsys):
    """``sparkv context ...`` with a key the server refuses says which flag sent it, as ``ask``
    does (the first-hour path printed the server's 401 alone)."""
    import sparkv.edge.client as client_mod
    from sparkv.cli import main
    from sparkv.protocol.errors import ApiError

    class Refused:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def list_contexts(self):
            raise ApiError(401, "invalid_api_key", "this key is not known")

    monkeypatch.setattr(client_mod, "EdgeClient", Refused)
    rc = main(["context", "list", "--server", "http://127.0.0.1:9", "--api-key", "skv_x"])
    err = capsys.readouterr().err
    assert rc != 0 and "invalid_api_key" in err and "sparkv context sends the key of --api-key" in err


def test_system_exit_messages_exit_2(capsys):
    # a benchmark's option check (raise SystemExit("...")) before anything loads
    _fails(["bench", "dynakv", "--decode-budgets", "2"], capsys, "--decode-budgets are fractions")


def test_the_console_script_prints_no_traceback():
    out = subprocess.run([sys.executable, "-m", "sparkv.cli", "device", "list", "--url",
                          NO_SERVER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "unreachable" in out.stderr


def test_every_option_is_stored_under_its_own_name():
    """One name per idea: ``--encryption-key`` lands in ``args.encryption_key``, never under an
    older name; ``sparkv --no-progress`` is the one exception (sparkv/cli.py says why)."""
    other = [f"{cmd} {a.option_strings[-1]} -> {a.dest}" for cmd, a in _actions()
             if a.option_strings and a.option_strings[-1].startswith("--")
             and a.dest != a.option_strings[-1][2:].replace("-", "_")]
    assert other == ["sparkv --no-progress -> no_progress_bars"], other


ASK = ["ask", "--server", NO_SERVER, "--context", CID, "q"]
DEVICE_SERVE = ["device", "serve", "--memory-budget-mb", "64"]


@pytest.mark.parametrize("argv", [
    [*ASK, "--key", "k"], [*ASK, "--ram-budget", "0.5"], [*ASK, "--new-tokens", "4"],
    ["serve", "--torch-threads", "2"], [*DEVICE_SERVE, "--budget-mb", "64"],
    [*DEVICE_SERVE, "--swap-dir", "d"], ["demo", "--out", "d"],
    ["bench", "server", "--duration", "3"],
    ["bench", "ttft", "--tokens", "2048"], ["bench", "dynakv", "--budgets", "0.5"],
    ["bench", "predictor", "--budget", "9"]])
def test_no_old_spelling_is_taken(argv, capsys):
    """The flags renamed for one name per idea have no second, hidden spelling."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {' '.join(argv[-2:])}" in capsys.readouterr().err


@pytest.mark.parametrize("given, expected", [({}, ["PASSIVE", "30000"]),
                                             ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "30000"]),
                                             ({"GOMP_SPINCOUNT": "0"}, ["PASSIVE", "0"])])
def test_the_command_sets_passive_openmp_waits_before_torch_loads(given, expected):
    """docs/edge.md, "Threads and OpenMP": ``sparkv`` sets OMP_WAIT_POLICY=PASSIVE and a short
    GOMP_SPINCOUNT before any command module imports torch (OpenMP reads them once, then); an
    explicit value wins."""
    code = ("import os, sys; import sparkv.cli as cli; "
            "cli.build_parser = lambda: sys.exit(print(os.environ.get('OMP_WAIT_POLICY'), "
            "os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)); cli.main(['--version'])")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(given)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.stdout.split() == [*expected, "False"], out.stderr


def test_quiet_and_verbose_set_the_one_logging_setup(capsys):
    import logging

    from sparkv.cli import verbosity

    parser = build_parser()
    assert verbosity(parser.parse_args(["-q", "model"])) == -1
    assert verbosity(parser.parse_args(["-vv", "model"])) == 2
    assert verbosity(parser.parse_args(["model"])) == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["-q", "-v", "model"])
    capsys.readouterr()
    from sparkv.logs import setup_logging

    log = logging.getLogger("sparkv.test")
    setup_logging(-1)
    log.info("a note")
    log.warning("a warning")
    setup_logging(0)
    log.info("another note")
    err = capsys.readouterr().err
    assert "a note" not in err and "a warning" in err and "another note" in err


# ---- issue 47: nothing heavy before the command runs; bad flags caught first; less noise ----------
HEAVY = ("torch", "transformers", "fastapi", "sparkv.runtime.model", "sparkv.server.app")


def _loaded_after(code: str) -> tuple[list[str], str]:
    """Runs ``code`` in a fresh interpreter; the :data:`HEAVY` modules it left loaded, and its
    stderr."""
    probe = ("import sys\ntry:\n" + "".join(f"    {line}\n" for line in code.splitlines())
             + "except SystemExit:\n    pass\n"
             f"print('LOADED', *(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[-1].split()[1:], out.stderr


@pytest.mark.parametrize("code", [
    "from sparkv.cli import build_parser\nbuild_parser()",
    "from sparkv.cli import main\nmain(['--help'])",
    "from sparkv.cli import main\nmain(['--version'])",
    "from sparkv.cli import main\nmain(['ask', '--help'])",
    "from sparkv.clidoc import render\nrender()",
])
def test_the_parsers_and_help_import_neither_torch_nor_transformers(code):
    """``sparkv --help``, ``--version`` and a command's ``--help`` build every parser without
    loading torch, transformers or the server (issue 47: they took 2.3 s)."""
    loaded, _ = _loaded_after(code)
    assert loaded == []


@pytest.mark.parametrize("argv, what", [
    (["ask", "--server", NO_SERVER, "--context", "not-an-id", "q"], "is not a context id"),
    (["ask", "--server", "127.0.0.1:8080", "--context", CID, "q"], "is not a server URL"),
    (["ask", "--server", NO_SERVER, "--context", CID, "--mbps", "0", "q"],
     "for an unshaped link give neither --mbps nor --trace"),
    (["ask", "--server", NO_SERVER, "--context", CID, "--max-new-tokens", "0", "q"],
     "is not a positive integer"),
    (["ask", "--server", NO_SERVER, "--context", CID, "--rtt-ms", "-5", "q"], "number >= 0"),
    (["ask", "--server", NO_SERVER, "--context", CID, "--temperature", "3", "q"],
     "is not a number in [0, 2]"),
    (["device", "ask", "--context", CID, "--top-k", "-1", "q"], "whole number >= 0"),
    (["device", "ask", "--context", CID, "--json-schema", "no-such.json", "q"],
     "not a readable JSON file"),
    (["device", "call", CID, "q", "--json-object", "--json-schema", "no-such.json"],
     "not a readable JSON file"),
    (["device", "ask", "--context", CID, "--logit-bias", "5", "q"], "is not ID=BIAS"),
    (["device", "ask", "--context", CID, "--logit-bias", "5=200", "q"], "a bias in [-100, 100]"),
    (["device", "call", CID, "q", "--presence-penalty", "3"], "is not a number in [-2, 2]"),
    (["context", "describe", "abc", "--server", NO_SERVER], "is not a context id"),
    (["device", "serve", "--flash-dir", "d", "--memory-budget-mb", "64", "--ask-server",
      "127.0.0.1:8080"], "is not a server URL"),
    (["context", "create", "f.txt", "--name", "a\nb", "--server", NO_SERVER],
     "is not a context name"),
])
def test_a_bad_flag_is_one_line_before_anything_loads(argv, what):
    """A malformed value is argparse's usage error: one line naming the flag and ``--help``,
    exit status 2, with neither torch nor the model loaded (not the server's 422)."""
    loaded, err = _loaded_after(f"from sparkv.cli import main\nmain({argv!r})")
    assert loaded == []
    assert err.count("\n") == 1 and what in err and "--help" in err, err
    assert err.startswith(f"sparkv {argv[0]}") and "usage:" not in err, err


def test_the_cli_names_match_the_code_they_name():
    """The parsers' light copies of the edge's strategies and the bundled traces."""
    from sparkv.cliflags import STRATEGY_NAMES, TRACE_NAMES
    from sparkv.edge.planning import STRATEGIES
    from sparkv.scheduler.trace import SAMPLE_TRACES

    assert sorted(STRATEGY_NAMES) == sorted(STRATEGIES)
    assert sorted(TRACE_NAMES) == sorted(SAMPLE_TRACES)


def test_a_sparkv_warning_is_one_line(capsys):
    """A press that fails the quality table (``QualityWarning``) prints as one line, without
    Python's source path and line of code; another library's warning as Python shows it."""
    import io
    import warnings

    from sparkv.cli import one_line_warning
    from sparkv.edge.client import QualityWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = one_line_warning
        warnings.warn(QualityWarning("press adakv:0.5 fails this model's\nquality table"))
    err = capsys.readouterr().err
    assert err == "sparkv: warning: press adakv:0.5 fails this model's quality table\n"
    other = io.StringIO()
    one_line_warning(UserWarning("theirs"), UserWarning, "/lib/their.py", 7, other)
    assert "/lib/their.py:7: UserWarning: theirs" in other.getvalue()


def test_quiet_prints_the_answer_without_the_breakdown(monkeypatch, capsys):
    """``sparkv -q ask`` prints the answer only; without ``-q`` the breakdown follows it."""
    from types import SimpleNamespace as NS

    from sparkv.edge.session import EdgeSession

    class Session:
        client = NS(encryption_keys={})

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def ask(self, *args, **kwargs):
            return NS(text=" the answer ", breakdown=NS(table=lambda: "THE TABLE"),
                      kept_id=None)

    monkeypatch.setattr(EdgeSession, "connect", lambda *a, **k: Session())
    ask = ["ask", "--server", NO_SERVER, "--context", CID, "--no-cache", "q"]
    assert main(["-q", *ask]) == 0
    assert capsys.readouterr().out == "the answer\n"
    assert main(ask) == 0
    assert capsys.readouterr().out == "the answer\n\nTHE TABLE\n"


def test_progress_bars_into_a_pipe_write_a_few_lines_and_none_after_no_progress(monkeypatch):
    """Into a pipe or a log, a bar is redrawn at most every 30 s (``bench contexts --quick``
    wrote 168 lines in 2 minutes); after ``--no-progress`` there is none, even though tqdm was
    imported before the flag was read."""
    import io

    import tqdm  # noqa: F401 - imported before the flag, as a command module may

    from sparkv.logs import disable_progress_bars, progress_bar

    sink = io.StringIO()
    bar = progress_bar(total=500, desc="bench", file=sink)
    for _ in range(500):
        bar.update(1)
    bar.close()
    drawn = sink.getvalue().replace("\r", "\n").strip().splitlines()
    assert 1 <= len([d for d in drawn if d.strip()]) <= 3 and "500/500" in drawn[-1]
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    disable_progress_bars()
    sink = io.StringIO()
    for _ in progress_bar(range(100), file=sink):
        pass
    assert sink.getvalue() == ""


def test_a_phase_progress_callback_draws_phases_and_nothing_when_bars_are_off(monkeypatch):
    """The encoder reports ``(phase, done, total)``; the callback names the bar after the phase
    and follows ``total``. With bars off (``--no-progress`` earlier in the process) tqdm's bar
    keeps no description: the callback still takes every report and draws nothing (it raised
    ``AttributeError: 'tqdm' object has no attribute 'desc'`` there)."""
    import io

    from sparkv.logs import phase_progress, progress_bar

    sink = io.StringIO()
    bar = progress_bar(total=None, unit="frame", desc="prefill", file=sink, mininterval=0)
    progress = phase_progress(bar)
    progress("prefill", 0, 4)
    progress("encode", 3, 4)
    progress("encode", 4, 4)
    bar.close()
    assert (bar.desc, bar.n, bar.total) == ("encode: ", 4, 4)
    assert "encode" in sink.getvalue() and "4/4" in sink.getvalue()
    monkeypatch.setenv("TQDM_DISABLE", "1")
    sink = io.StringIO()
    bar = progress_bar(total=None, desc="prefill", file=sink)
    progress = phase_progress(bar)
    for done in range(5):
        progress("encode", done, 4)
    bar.close()
    assert sink.getvalue() == ""


def test_loading_the_model_draws_no_loading_weights_bar():
    """transformers' ``Loading weights`` bar is not drawn (it was, on every command that loads
    the model); run in a fresh interpreter, as a command is."""
    from helpers import shared_tiny_checkpoint

    code = ("import sys\nfrom sparkv.runtime.model import load_model\n"
            f"load_model({str(shared_tiny_checkpoint())!r})\nprint('loaded')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout == "loaded\n", out.stderr
    assert "Loading weights" not in out.stderr, out.stderr


def test_the_gil_switch_interval_comes_from_the_environment(monkeypatch, capsys):
    """``SPARKV_SWITCH_INTERVAL_US`` sets CPython's switch interval for the command (the GPU
    check's ``ttftswitch`` phase); a value that is not a positive number is refused, named."""
    import sys

    default = sys.getswitchinterval()
    try:
        monkeypatch.setenv("SPARKV_SWITCH_INTERVAL_US", "200")
        assert main(["--version"]) == 0
        assert sys.getswitchinterval() == pytest.approx(200e-6)
        for bad in ("fast", "0", "-5", "nan"):
            sys.setswitchinterval(default)
            monkeypatch.setenv("SPARKV_SWITCH_INTERVAL_US", bad)
            assert main(["--version"]) == 2
            assert "SPARKV_SWITCH_INTERVAL_US" in capsys.readouterr().err
            assert sys.getswitchinterval() == default
    finally:
        sys.setswitchinterval(default)
