"""Conventions of the command and the library: ``--version``, log messages
through the ``gpukv`` logger (the library prints nothing), one number format
for every command, the trace found through ``GPUKV_TRACE``, install hints
that work from a checkout, and the benchmarks saying why they were skipped.

The command runs in-process (``gpukv.cli.main``) on small workloads."""

from __future__ import annotations

import ast
import json
import logging
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import gpukv
from gpukv import cli
from gpukv.sim import report
from gpukv.sim import simulate as sim
from gpukv.sim import workload as workloads

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--conversations", "4", "--duration", "2", "--backend", "cpu", "--no-progress", "--tokens-per-block", "32"]
# Four requests, some longer than a pool of 8 pages of 32 tokens: the simulator rejects those.
TOO_SMALL_POOL = ["--conversations", "4", "--duration", "1", "--seed", "2", "--pages", "8", "--model", "attention",
                  "--backend", "cpu", "--no-progress", "--tokens-per-block", "32"]


# -- the version ---------------------------------------------------------------------------------------
def test_version_flag_prints_the_package_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"gpukv {gpukv.__version__}\n"


def test_version_is_written_once_and_agrees_with_the_package_metadata():
    import importlib.metadata

    text = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'version = { attr = "gpukv.__version__" }' in text
    assert not re.search(r'^version = "', text, re.M)  # no second copy in [project]
    assert importlib.metadata.version("gpukv") == gpukv.__version__


# -- logging -----------------------------------------------------------------------------------------
def _library_modules():
    return [p for p in (REPO / "gpukv").rglob("*.py") if p.name != "cli.py"]


def test_the_library_has_no_print_or_warning_calls():
    """Only the command prints; the library logs (``logging.getLogger("gpukv...")``)."""
    found = []
    for path in _library_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else ast.unparse(f)
            if name in ("print", "warnings.warn", "sys.stderr.write", "sys.stdout.write"):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert found == []


def test_the_gpukv_logger_is_silent_unless_configured():
    logger = logging.getLogger("gpukv")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)  # no "last resort" stderr output


def test_a_rejected_request_is_logged_not_printed(capsys, caplog):
    w = workloads.default_workload(4, seed=2, tokens_per_block=32, duration_s=1.0)
    s = sim.Simulator(w, sim.SimOptions(backend="cpu", tokens_per_block=32, pages=8, model="attention"))
    with caplog.at_level(logging.WARNING, logger="gpukv"):
        s.run()
    assert s.stats.rejected > 0
    msgs = [r.getMessage() for r in caplog.records if r.name == "gpukv.simulate"]
    assert len(msgs) == s.stats.rejected and all("does not fit in the pool of 8 pages" in m for m in msgs)
    assert capsys.readouterr().err == ""


def test_the_command_shows_the_library_log_on_stderr(capsys):
    logger = logging.getLogger("gpukv")
    before = (list(logger.handlers), logger.level)
    assert cli.main([*TOO_SMALL_POOL, "--json"]) == 0
    cap = capsys.readouterr()
    summary = json.loads(cap.out)  # stdout stays the JSON document alone
    rejected = [line for line in cap.err.splitlines() if line.startswith("gpukv simulate: request ")]
    assert summary["rejected"] > 0 and len(rejected) == summary["rejected"]
    assert (list(logger.handlers), logger.level) == before  # main leaves the logger as it found it


# -- number formats ------------------------------------------------------------------------------------
def _rows(text):
    """label -> value columns of a summary table (labels and values are split by 2+ spaces)."""
    out = {}
    for line in text.splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) >= 2:
            out[parts[0]] = parts[1:]
    return out


def _kind(value: str) -> str:
    if re.fullmatch(r"\d+(\.\d+)?%", value):
        return "percent"
    if re.fullmatch(r"\d{1,3}(,\d{3})*", value):
        return "integer"
    if re.fullmatch(r"[\d,]*\.?\d+(e[+-]\d+)?", value):
        return "number"
    return "text"


def test_match_and_simulate_format_numbers_alike(capsys):
    assert cli.main(["match", "--conversations", "6", "--backend", "cpu"]) == 0
    match = _rows(capsys.readouterr().out)
    assert cli.main(SMALL) == 0
    simulate = _rows(capsys.readouterr().out)
    shared = [k for k in match if k in simulate]
    assert {"input tokens", "hit rate (reused / input tokens)", "match_batch latency p50 (ms)"} <= set(shared)
    for k in shared:
        assert _kind(match[k][0]) == _kind(simulate[k][0]), (k, match[k], simulate[k])
    assert _kind(match["hit rate (reused / input tokens)"][0]) == "percent"
    tokens = match["input tokens"][0]
    assert _kind(tokens) == "integer" and int(tokens.replace(",", "")) >= 1000 and "," in tokens


# -- the compare table ---------------------------------------------------------------------------------
def _summary(**changes):
    base = {"policy": "per-page", "host_pages_per_life_cycle": 0, "hit_rate": 0.9, "ssm_snapshot_hits": 10,
            "ssm_snapshot_hit_rate": 0.99, "evicted_pages": 100, "migrated_pages": 0, "dropped_pages": 0}
    return {**base, **changes}


def test_compare_keeps_an_of_which_row_under_its_row():
    a = _summary(host_pages_per_life_cycle=64, migrated_pages=7)
    b = _summary(host_pages_per_life_cycle=64, migrated_pages=7, policy="full-blocks", evicted_pages=90)
    lines = report.format_summary(a, b).splitlines()
    evicted = next(i for i, line in enumerate(lines) if line.startswith("pages evicted"))
    assert lines[evicted + 1].startswith("  of which migrated to host")
    assert lines[evicted + 1].split()[-2:] == ["7", "7"]  # shown with both runs, beside the row it breaks down


def test_no_migration_row_without_a_host_tier():
    text = report.format_summary(_summary(), _summary(policy="full-blocks", evicted_pages=90))
    assert "migrated" not in text
    ssm = next(line for line in text.splitlines() if line.startswith("SSM snapshot hit rate"))
    assert ssm.split()[-1] == "99.00%"


# -- the trace -----------------------------------------------------------------------------------------
def _trace(tmp_path):
    p = tmp_path / "small_trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 100, "input_length": 900, "output_length": 3, "hash_ids": [1, 3]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


@pytest.mark.parametrize("command", ["simulate", "match"])
def test_trace_without_a_path_is_gpukv_trace(command, tmp_path, monkeypatch, capsys):
    path = _trace(tmp_path)
    monkeypatch.setenv("GPUKV_TRACE", str(path))
    extra = ["--model", "attention", "--no-progress"] if command == "simulate" else ["--batch", "1"]
    assert cli.main([command, "--trace", "--backend", "cpu", "--tokens-per-block", "32", "--json", *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    assert str(path) in out["workload"] and out["requests"] == 2
    assert out["reused_tokens"] == 512  # the second request reuses the first's shared 512-token block


def test_trace_without_a_path_or_gpukv_trace_says_what_to_set(monkeypatch, capsys):
    monkeypatch.setattr("gpukv.sim.workload.find_mooncake_trace", lambda: None)
    assert cli.main(["--trace", "--backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--trace without FILE needs $GPUKV_TRACE" in err and "Traceback" not in err


def test_trace_help_says_where_the_trace_comes_from(capsys):
    assert cli.main(["simulate", "--help"]) == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines at spaces and hyphens
    assert "WithoutFILE:$GPUKV_TRACE" in text and "github.com/kvcache-ai/Mooncake" in text


# -- install hints -------------------------------------------------------------------------------------
def test_plot_hint_installs_from_the_checkout(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(report.MissingDependency, match=re.escape("pip install -e '.[plot]'")):
        report.require_matplotlib()


# -- the benchmarks ------------------------------------------------------------------------------------
class _Reporter:
    def __init__(self, skipped):
        self.stats = {"skipped": skipped}
        self.lines = []

    def write_sep(self, sep, title):
        self.lines.append(title)

    def write_line(self, line):
        self.lines.append(line)


def test_benchmarks_say_once_why_they_were_skipped():
    from bench import conftest

    reason = ("bench/test_match.py", 1, f"Skipped: {conftest.TRACE_SKIP}")
    other = ("bench/test_match.py", 2, "Skipped: batch 1024 needs more than the 10 queries")
    rep = _Reporter([SimpleNamespace(longrepr=reason)] * 3 + [SimpleNamespace(longrepr=other)])
    conftest.pytest_terminal_summary(rep)
    text = "\n".join(rep.lines)
    assert text.count("3 benchmark(s) skipped") == 1 and "GPUKV_TRACE" in text and "kvcache-ai/Mooncake" in text
    quiet = _Reporter([SimpleNamespace(longrepr=other)])
    conftest.pytest_terminal_summary(quiet)
    assert quiet.lines == []


# -- the figure ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def both_runs():
    out = []
    for policy in sim.POLICIES:
        w = workloads.default_workload(12, seed=3, tokens_per_block=32, duration_s=10.0)
        s = sim.Simulator(w, sim.SimOptions(policy=policy, tokens_per_block=32, backend="cpu"))
        s.run()
        out.append(s)
    return out


def test_plot_series_shows_what_per_page_coverage_saves(both_runs):
    data = report.plot_series(both_runs)
    per_page, full_blocks = data["runs"]
    for run, s in zip(data["runs"], both_runs):
        assert run["computed"][-1] == run["total_computed"] == s.stats.computed_tokens
        assert run["ssm_hits"][-1] == run["total_ssm_hits"] == s.stats.ssm_hits > 0
        assert (np.diff(run["computed"]) >= 0).all() and (np.diff(run["t_s"]) > 0).all()
    saved = data["saved"]
    assert saved["total"] == full_blocks["total_computed"] - per_page["total_computed"] > 0
    assert saved["tokens"][-1] == saved["total"] and saved["tokens"][0] == 0
    assert len(saved["t_s"]) >= max(len(per_page["t_s"]), len(full_blocks["t_s"]))
    assert report.plot_series(both_runs[:1])["saved"] is None  # one policy: nothing to compare with


def test_plot_of_one_run_and_of_both(both_runs, tmp_path):
    pytest.importorskip("matplotlib")
    for runs, name in ((both_runs, "both.png"), (both_runs[1:], "one.png")):
        report.plot(runs, str(tmp_path / name))
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_runs_without_requests(tmp_path):
    pytest.importorskip("matplotlib")
    runs = []
    for policy in sim.POLICIES:
        s = sim.Simulator(workloads.Workload([], "nothing"), sim.SimOptions(policy=policy, pages=16, backend="cpu"))
        s.run()
        runs.append(s)
    assert report.plot_series(runs)["saved"]["total"] == 0
    report.plot(runs, str(tmp_path / "empty.png"))
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_an_unknown_flag_is_reported_with_the_commands_own_usage(capsys):
    assert cli.main(["simulate", "--polcy", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gpukv simulate") and "unrecognized arguments: --polcy x" in err, err
    assert cli.main(["match", "--bogus"]) == 2
    assert capsys.readouterr().err.startswith("usage: gpukv match")


def test_every_option_of_every_command_says_what_it_is_for():
    parser = cli.build_parser()
    for name, command in parser.commands.items():
        assert command.description, f"gpukv {name} has no description"
        for action in command._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"gpukv {name} {action.option_strings[0]} has no help"


def test_a_limit_says_how_many_requests_the_run_takes(capsys):
    assert cli.main([*SMALL, "--limit", "0", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["requests"] == 0
    assert summary["workload"].endswith("of which the first 0 (--limit)"), summary["workload"]


# -- --quiet and --verbose ----------------------------------------------------------------------------
def _say_at_every_level(args) -> int:
    log = logging.getLogger("gpukv.probe")
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        log.log(level, "said at %s", logging.getLevelName(level))
    print("the result")
    return 0


@pytest.mark.parametrize("flags, shown", [
    ([], ["INFO", "WARNING", "ERROR"]),
    (["--quiet"], ["ERROR"]),
    (["-q"], ["ERROR"]),
    (["--verbose"], ["DEBUG", "INFO", "WARNING", "ERROR"]),
    (["-v"], ["DEBUG", "INFO", "WARNING", "ERROR"]),
])
def test_quiet_and_verbose_choose_the_log_messages_shown(flags, shown, monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "info", _say_at_every_level)
    assert cli.main(["info", *flags]) == 0
    cap = capsys.readouterr()
    assert cap.out == "the result\n"  # results are never silenced
    said = [line.split()[-1] for line in cap.err.splitlines() if line.startswith("gpukv probe: said at ")]
    assert said == shown
    assert ("gpukv cli: gpukv " in cap.err) == ("DEBUG" in shown)  # --verbose names the backend and kernel cache


def test_quiet_and_verbose_exclude_each_other(capsys):
    assert cli.main(["info", "--quiet", "--verbose"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_quiet_silences_the_compile_notes_and_the_progress(monkeypatch, capsys):
    from gpukv import compile as jobs
    from gpukv import kernel_cache

    monkeypatch.setattr(kernel_cache, "missing", lambda target: ["seq"])

    def fake_compile(config, progress=None):
        if progress is not None:  # --quiet passes none
            progress("compiling", "seq")
            progress("ready", "seq")
        return {"seq": "compiled"}

    monkeypatch.setattr(jobs, "compile_kernels", fake_compile)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cli.main(["compile", "--backend", "cpu"]) == 0
    loud = capsys.readouterr()
    assert "gpukv: compiling 1 of" in loud.err and "kernels compiled in" in loud.err and "7/7 kernels" in loud.err
    assert cli.main(["compile", "--backend", "cpu", "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == loud.out  # the result line stays
    assert "(1 compiled now" in quiet.out


@pytest.mark.parametrize("flags", [[], ["--no-progress"], ["--quiet", "--json"]])
def test_match_compiles_what_the_kernel_cache_lacks(flags, monkeypatch, capsys):
    """``gpukv match`` on a machine that lacks a kernel compiles it first,
    with the compile notes of every command (it once passed a bool where
    the command's options go, and failed on a cold kernel cache)."""
    from gpukv import compile as jobs
    from gpukv import kernel_cache

    compiled = []
    monkeypatch.setattr(kernel_cache, "missing", lambda target: ["match"])
    monkeypatch.setattr(jobs, "compile_kernels", lambda config, progress=None: compiled.append(config) or {})
    assert cli.main(["match", "--limit", "3", "--pages", "4096", *flags]) == 0
    err = capsys.readouterr().err
    assert len(compiled) == 1 and compiled[0].tokens_per_block == 32
    assert ("gpukv: compiling 1 of" in err) == ("--quiet" not in flags)


def test_quiet_simulate_prints_its_summary_alone(capsys):
    assert cli.main([*TOO_SMALL_POOL, "--json", "--quiet"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["rejected"] > 0  # the warnings about them are what --quiet leaves out
    assert cap.err == ""


# -- the documentation ships with the package --------------------------------------------------------
def test_info_says_where_the_docs_are(capsys):
    assert cli.main(["info", "--backend", "cpu"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("docs: ")]
    assert line and line[0].startswith(f"docs: {REPO} ")  # a checkout: its own README.md and docs/
    assert "`gpukv info` prints where" in cli.build_parser().format_help().replace("\n", " ").replace("  ", " ")


def test_an_install_finds_the_docs_in_its_share_folder(tmp_path, monkeypatch):
    import sysconfig

    share = tmp_path / "share" / "doc" / "gpukv"
    (share / "docs").mkdir(parents=True)
    (share / "README.md").write_text("# gpukv\n")
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "gpukv" / "cli.py"))
    monkeypatch.setattr(sysconfig, "get_path", lambda name, scheme=None: str(tmp_path))
    assert cli.docs_folder() == str(share)
    (share / "README.md").unlink()
    assert cli.docs_folder() is None


def test_the_wheel_ships_the_readme_and_every_doc(tmp_path):
    """The wheel's data files are README.md and docs/*.md, laid out as in the
    repository under share/doc/gpukv (so the links between them hold)."""
    import subprocess
    import zipfile

    import shutil

    pytest.importorskip("setuptools", minversion="70.1")  # builds wheels without the wheel package
    src = tmp_path / "src"  # a copy: a build writes build/ and *.egg-info into the tree it builds
    src.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "docs", src / "docs")
    shutil.copytree(REPO / "gpukv", src / "gpukv", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    [wheel] = tmp_path.glob("gpukv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.split("/share/doc/gpukv/", 1)[1] for n in names if "/share/doc/gpukv/" in n)
    expected = sorted(["README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
    assert shipped == expected


# -- the compile progress moves ------------------------------------------------------------------------
def _slow_compile(monkeypatch, seconds: float):
    """compile_kernels with one job (seq and tree) that takes ``seconds``,
    in this process; the kernels count as cached once it is done."""
    from gpukv import compile as jobs

    left = ["seq", "tree"]
    monkeypatch.setattr(jobs, "missing", lambda target: [left.pop() for _ in list(left)][::-1])
    monkeypatch.setattr(jobs, "run_job", lambda config, job: time.sleep(seconds))
    return jobs


@pytest.mark.parametrize("terminal", [True, False])
def test_the_compile_progress_shows_each_kernels_elapsed_time_while_it_compiles(terminal, monkeypatch):
    import io

    jobs = _slow_compile(monkeypatch, 0.6)
    out = io.StringIO()
    clock = lambda: time.monotonic() * 50  # noqa: E731 -- 0.6 s of the job reads as 30 s
    with cli.CompileProgress(6, ["commit", "hash", "match", "compact"], out=out, terminal=terminal,
                              interval=0.1, clock=clock) as progress:
        result = jobs.compile_kernels(gpukv.CacheConfig(backend="cpu"), progress=progress, processes=1)
    assert result["seq"] == result["tree"] == "compiled"
    text = out.getvalue()
    shown = text.split("\r") if terminal else text.splitlines()
    during = [int(m.group(1)) for m in map(re.compile(r"compiling:? seq (\d+) s, tree \d+ s").search, shown) if m]
    assert len(during) >= 3, text  # redrawn (or written) while the job ran, not only when it started or ended
    assert during == sorted(during) and during[-1] - during[0] >= 10  # the elapsed time moves
    if terminal:
        assert "6/6 kernels  compiling: -" in shown[-1] and text.endswith("\n")
    else:
        assert "(4/6 kernels ready," in text and text.splitlines()[-1].startswith("gpukv: 6/6 kernels: tree ready")


def test_the_compile_progress_ticks_every_second_on_a_terminal_and_every_ten_on_a_pipe():
    import io

    CompileProgress = cli.CompileProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert CompileProgress(6, out=Terminal()).interval == 1.0
    assert CompileProgress(6, out=io.StringIO()).interval == 10.0
    assert CompileProgress(6, out=Terminal(), terminal=False).interval == 10.0  # --no-progress on a terminal


# -- the CUDA probe is lazy and cheap ------------------------------------------------------------------
def test_a_cpu_manager_never_probes_for_cuda():
    import os
    import subprocess

    code = ("import sys, gpukv; from gpukv.core import backend; "
            "gpukv.KVCacheManager(gpukv.CacheConfig(backend='cpu')); "
            "print(backend.cuda_unusable_reason.cache_info().currsize, 'cupy' in sys.modules, "
            "any(m == 'numba_cuda' or m.startswith('numba.cuda') for m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k not in ("GPUKV_BACKEND", "NUMBA_ENABLE_CUDASIM")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False", "False"]  # not asked, nothing of CUDA imported


def test_auto_without_a_cuda_driver_imports_neither_cupy_nor_numba_cuda(monkeypatch):
    """With the cuda extra installed on a machine without a GPU, ``auto``
    stops at the driver: CuPy and numba.cuda cost a second or more to import."""
    import builtins

    from gpukv.core import backend

    monkeypatch.setattr(backend, "simulator_enabled", lambda: False)
    monkeypatch.setattr(backend, "_installed", lambda name: True)  # as if the cuda extra were there
    monkeypatch.setattr(backend, "cuda_driver_missing", lambda: "no CUDA driver here (the test's)")
    monkeypatch.delenv("GPUKV_BACKEND", raising=False)
    imported = []
    real_import = builtins.__import__

    def recording(name, globals=None, locals=None, fromlist=(), level=0):
        imported.extend([name, *(f"{name}.{f}" for f in fromlist or ())])
        return real_import(name, globals, locals, fromlist, level)

    backend.cuda_unusable_reason.cache_clear()
    monkeypatch.setattr(builtins, "__import__", recording)
    try:
        assert backend.resolve("auto") == "cpu"
        assert backend.cuda_unusable_reason() == "no CUDA driver here (the test's)"
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
        backend.cuda_unusable_reason.cache_clear()
    assert not [n for n in imported if n.split(".")[0] in ("cupy", "numba_cuda") or n.startswith("numba.cuda")]


def test_the_cuda_probe_says_what_is_missing(monkeypatch):
    from gpukv.core import backend

    monkeypatch.setattr(backend, "simulator_enabled", lambda: False)
    monkeypatch.setattr(backend, "_installed", lambda name: False)
    backend.cuda_unusable_reason.cache_clear()
    try:
        assert backend.cuda_unusable_reason() == "CuPy is not installed (pip install 'gpukv[cuda]')"
    finally:
        backend.cuda_unusable_reason.cache_clear()
    monkeypatch.setattr(backend, "_DRIVER_LIBRARY", "libgpukv-no-such-driver.so.1")
    assert "libgpukv-no-such-driver.so.1 does not load" in backend.cuda_driver_missing()


# -- an unwritable kernel cache is said, once ------------------------------------------------------
def _announced_afresh(monkeypatch, caplog, kept: dict):
    from gpukv import kernel_cache

    monkeypatch.setattr(kernel_cache, "folders", lambda target: kept)
    monkeypatch.setattr(kernel_cache, "missing", lambda target: ["seq"])
    monkeypatch.setattr(kernel_cache, "_announced", set())
    with caplog.at_level(logging.INFO, logger="gpukv"):
        kernel_cache.announce("cpu")
        kernel_cache.announce("cpu")  # once per process
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "gpukv"]


def test_kernels_that_cannot_be_kept_are_warned_about_once(monkeypatch, caplog):
    said = _announced_afresh(monkeypatch, caplog, {"seq": None, "tree": "/x"})
    warnings = [m for level, m in said if level == "WARNING"]
    assert len(warnings) == 1 and "cannot be kept on disk" in warnings[0] and "GPUKV_CACHE_DIR" in warnings[0]
    [info] = [m for level, m in said if level == "INFO"]
    assert "kept in" not in info  # it does not claim a folder that holds nothing


def test_kernels_kept_elsewhere_say_where(monkeypatch, caplog):
    from gpukv.core.backend import CACHE_DIR

    said = _announced_afresh(monkeypatch, caplog, {"seq": "/pkg/gpukv/kernels/__pycache__"})
    [(level, warning), (_, info)] = said
    assert level == "WARNING" and f"the kernel cache {CACHE_DIR} cannot be written" in warning
    assert "kept in /pkg/gpukv/kernels/__pycache__ instead" in warning
    assert "kept in /pkg/gpukv/kernels/__pycache__ for every later run" in info


def test_a_writable_kernel_cache_keeps_every_kernel_and_warns_of_nothing(monkeypatch, caplog):
    from gpukv import kernel_cache
    from gpukv.core.backend import CACHE_DIR

    assert kernel_cache.where_kept("cpu") == CACHE_DIR
    assert set(kernel_cache.folders("cpu")) >= set(kernel_cache.KERNEL_NAMES)
    said = _announced_afresh(monkeypatch, caplog, {"seq": CACHE_DIR + "/gpukv_kernels"})
    assert [level for level, _ in said] == ["INFO"] and f"kept in {CACHE_DIR} for every later run" in said[0][1]


def test_an_unwritable_cache_dir_names_the_folder_numba_falls_back_to(tmp_path):
    import os
    import subprocess

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a folder cannot be made under a file, even by root
    code = ("import logging, gpukv; from gpukv import kernel_cache; logging.basicConfig(); "
            "print(kernel_cache.where_kept('cpu')); gpukv.KVCacheManager(gpukv.CacheConfig(backend='cpu'))")
    env = {k: v for k, v in os.environ.items() if k not in ("GPUKV_BACKEND", "NUMBA_ENABLE_CUDASIM")}
    env["GPUKV_CACHE_DIR"] = str(blocked / "cache")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    kept = out.stdout.strip()
    assert kept and not kept.startswith(str(blocked))
    warnings = [line for line in out.stderr.splitlines() if "cannot be written" in line]
    assert len(warnings) == 1 and f"kept in {kept} instead" in warnings[0]


def test_compile_refuses_a_kernel_cache_it_cannot_write(tmp_path):
    """``gpukv compile`` builds the cache later processes read: a
    GPUKV_CACHE_DIR that cannot be made is an error (exit 2, naming it),
    before anything compiles, not kernels kept somewhere else."""
    import os
    import subprocess

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a folder cannot be made under a file, even by root
    env = {k: v for k, v in os.environ.items() if k not in ("GPUKV_BACKEND", "NUMBA_ENABLE_CUDASIM")}
    env["GPUKV_CACHE_DIR"] = str(blocked / "cache")
    out = subprocess.run([sys.executable, "-m", "gpukv.cli", "compile", "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert f"the kernel cache {blocked / 'cache'}" in out.stderr and "(GPUKV_CACHE_DIR) cannot be written" in out.stderr
    assert "compiling" not in out.stderr


def test_plot_help_describes_the_figure_it_draws(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for panel in ("tokens computed over time", "the recomputation per-page coverage saves",
                  "SSM snapshot hits over time, on a block boundary and inside one", "match_batch latency"):
        assert panel in text, panel


def test_a_call_on_a_cache_of_the_wrong_status_reads_as_english():
    mgr = gpukv.KVCacheManager(gpukv.CacheConfig(tokens_per_block=4, layers=[gpukv.Attention()],
                                                 pages_per_life_cycle=8, backend="cpu"))
    kv = mgr.create_kv_cache()  # SUSPENDED
    with pytest.raises(gpukv.LogicError, match=r"needs an ACTIVE KV cache; this one is SUSPENDED"):
        kv.resize(4)
    kv.close()
    with pytest.raises(gpukv.LogicError, match=r"needs a SUSPENDED KV cache; this one is CLOSED"):
        kv.resume()
