"""``gpukv simulate``: the scheduler loop, its two policies, the trace replay
and the command line (``gpukv.cli.main`` called in-process, with capsys).

The scenarios run small built-in chat workloads on the cpu backend; each
asserts outcomes of the whole run (every request finished, hit rates, page
pressure handled, the tables sane afterwards)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpukv import cli, introspect
from gpukv.sim.simulate import SimOptions, Simulator, auto_pages
from gpukv.sim.report import format_summary, summarize
from gpukv.sim.workload import default_workload, find_mooncake_trace, trace_workload


def run(workload, **options):
    options.setdefault("backend", "cpu")
    sim = Simulator(workload, SimOptions(**options))
    sim.run()
    return sim, summarize(sim, 0.0)


def finished_cleanly(sim, summary):
    """Every request finished, no cache is left open, and the tables are sane."""
    assert summary["finished"] + summary["rejected"] == summary["requests"] == len(sim.workload.requests)
    assert not sim.running and not sim.waiting and not sim.swapped
    assert introspect.num_open_caches(sim.mgr) == 0
    introspect.check_sanity(sim.mgr)


# -- the two policies ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def both_policies():
    out = {}
    for policy in ("per-page", "full-blocks"):
        w = default_workload(16, seed=3, tokens_per_block=32, duration_s=20.0)
        out[policy] = (w, *run(w, policy=policy, tokens_per_block=32))
    return out


def test_per_page_coverage_reuses_more_than_full_blocks(both_policies):
    _, sim_pp, pp = both_policies["per-page"]
    _, sim_fb, fb = both_policies["full-blocks"]
    for sim, s in ((sim_pp, pp), (sim_fb, fb)):
        finished_cleanly(sim, s)
        assert s["rejected"] == 0
    assert pp["input_tokens"] == fb["input_tokens"] > 0
    assert pp["hit_rate"] > fb["hit_rate"] > 0.3
    # Per-page reuses end inside blocks (rewind endpoints); full blocks never do.
    assert pp["reuses_ending_mid_block"] > 0 and pp["reused_tokens_from_partial_endpoints"] > 0
    assert fb["reuses_ending_mid_block"] == 0 and fb["reused_tokens_from_partial_endpoints"] == 0
    # Every reuse on the hybrid model ends on an SSM checkpoint.
    assert pp["ssm_snapshot_hits"] == pp["reuses"] > 0


def test_per_page_never_reuses_less_for_a_request(both_policies):
    """Request by request: per-page coverage reuses at least the block-aligned
    part of what full blocks reuse, and follow-ups reuse the previous turn's
    whole endpoint (a turn's end is a commit endpoint, usually mid-block)."""
    w_pp, _, _ = both_policies["per-page"]
    w_fb, _, _ = both_policies["full-blocks"]
    pp = np.array([r.reused for r in w_pp.requests])
    fb = np.array([r.reused for r in w_fb.requests])
    assert (fb % 32 == 0).all()
    assert (pp >= fb).all()
    assert (pp > fb).sum() >= len(pp) // 4


def test_follow_up_reuses_the_previous_turn_to_its_end(both_policies):
    """A follow-up's prompt starts with the previous turn's computed tokens
    (its prompt and reply but the last reply token); with enough pages
    nothing is evicted, so the follow-up reuses exactly that much."""
    w, _, s = both_policies["per-page"]
    if s["evicted_pages"] or s["preemptions"]:
        pytest.skip("the pool was under pressure in this run")
    by_rid = {r.rid: r for r in w.requests}
    checked = 0
    for r in w.requests:
        prev = by_rid.get(r.after)
        if r.kind == "follow_up" and prev is not None:
            assert r.reused == prev.compute_len
            checked += 1
    assert checked > 5


def test_the_ssm_panel_tells_the_policies_apart(both_policies):
    """Both policies hit an SSM snapshot for nearly the same requests (every
    reuse of a hybrid model ends on one): the figure splits the hits by where
    the snapshot lies, which is what per-page coverage changes."""
    from gpukv.sim.report import plot_series

    sims = {p: both_policies[p][1] for p in ("per-page", "full-blocks")}
    runs = {r["label"]: r for r in plot_series(list(sims.values()))["runs"]}
    pp, fb = runs["per-page"], runs["full-blocks"]
    for label, r in runs.items():
        s = sims[label].stats
        assert r["ssm_hits_boundary"][-1] + r["ssm_hits_inside"][-1] == r["ssm_hits"][-1] == s.ssm_hits > 0
        assert np.all(np.diff(r["ssm_hits_inside"]) >= 0) and np.all(np.diff(r["ssm_hits_boundary"]) >= 0)
    assert not fb["ssm_hits_inside"].any()  # whole blocks only: every snapshot hit is on a boundary
    assert pp["ssm_hits_inside"][-1] == pp["total_ssm_hits_inside"] == sims["per-page"].stats.partial_reuses > 0
    assert pp["ssm_hits_boundary"][-1] < fb["ssm_hits_boundary"][-1]


def test_format_summary_side_by_side(both_policies):
    text = format_summary(both_policies["per-page"][2], both_policies["full-blocks"][2])
    assert "per-page" in text and "full-blocks" in text
    hit = next(line for line in text.splitlines() if line.startswith("hit rate"))
    assert [v.endswith("%") for v in hit.split()[-3:]] == [False, True, True]  # one value per run


# -- page pressure -------------------------------------------------------------------------------
def test_tight_pool_preempts_evicts_and_finishes():
    """A pool that holds about two requests' pages: admission is refused,
    running requests are preempted and re-admitted, cached pages are
    evicted, and every request still finishes."""
    w = default_workload(10, seed=5, tokens_per_block=32, duration_s=2.0)
    longest = max(-(-r.compute_len // 32) for r in w.requests)
    sim, s = run(w, tokens_per_block=32, pages=2 * longest + 8)
    finished_cleanly(sim, s)
    assert s["rejected"] == 0
    assert s["evicted_pages"] > 0 and s["preemptions"] > 0
    assert s["hit_rate"] > 0


def test_request_larger_than_the_pool_is_rejected_not_fatal(caplog):
    w = default_workload(4, seed=2, tokens_per_block=32, duration_s=1.0)
    with caplog.at_level("WARNING", logger="gpukv"):
        sim, s = run(w, tokens_per_block=32, pages=8, model="attention")  # 8 pages = 256 tokens
    finished_cleanly(sim, s)
    assert s["rejected"] > 0
    assert "does not fit in the pool" in caplog.text


def test_host_tier_preemption_suspends_and_resumes():
    w = default_workload(8, seed=7, tokens_per_block=32, duration_s=2.0)
    longest = max(-(-r.compute_len // 32) for r in w.requests)
    sim, s = run(w, tokens_per_block=32, pages=2 * longest + 8, host_pages=4 * longest)
    finished_cleanly(sim, s)
    assert s["rejected"] == 0


def test_auto_pages_fit_the_longest_request_but_not_the_workload():
    w = default_workload()  # the default workload
    blocks = [-(-r.compute_len // 64) for r in w.requests]
    pages = auto_pages(w.requests, SimOptions())
    assert 2 * max(blocks) <= pages < sum(blocks) / 5


def test_deterministic():
    w1 = default_workload(6, seed=11, tokens_per_block=32, duration_s=5.0)
    w2 = default_workload(6, seed=11, tokens_per_block=32, duration_s=5.0)
    _, a = run(w1, tokens_per_block=32, order="arrival", model="attention")
    _, b = run(w2, tokens_per_block=32, order="arrival", model="attention")
    timing = {k for k in a if k.endswith(("_ms", "_s", "tokens_per_s"))}
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}


# -- the trace -------------------------------------------------------------------------------------
def write_trace(tmp_path, lines):
    p = tmp_path / "trace.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def test_trace_replay_shares_prefix_blocks(tmp_path):
    """Requests sharing hash ids share tokens: the second and third reuse the
    first's 512-token blocks (the third also the second's)."""
    path = write_trace(tmp_path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 5000, "input_length": 1500, "output_length": 4, "hash_ids": [1, 2, 4]},
        {"timestamp": 9000, "input_length": 1400, "output_length": 2, "hash_ids": [1, 2, 4]},
    ])
    w = trace_workload(path)
    sim, s = run(w, model="attention", tokens_per_block=32)
    finished_cleanly(sim, s)
    assert [r.reused for r in w.requests] == [0, 1024, 1399]  # the third: all but its last prompt token


def test_real_trace_first_requests():
    path = find_mooncake_trace()
    if path is None:
        pytest.skip("the Mooncake trace is not in shared/data (set GPUKV_TRACE)")
    w = trace_workload(path, limit=12)
    sim, s = run(w)
    finished_cleanly(sim, s)
    assert s["requests"] == 12 and s["hit_rate"] > 0  # they share hash id 0 (a system prompt)


# -- the command line ------------------------------------------------------------------------------
SMALL = ["--conversations", "4", "--duration", "2", "--backend", "cpu", "--no-progress"]


def test_cli_default_command_is_simulate_json(capsys):
    assert cli.main([*SMALL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "per-page" and out["finished"] == out["requests"] > 0


def test_cli_compare_prints_both_policies(capsys):
    assert cli.main(["simulate", *SMALL, "--compare"]) == 0
    out = capsys.readouterr().out
    assert "per-page" in out and "full-blocks" in out and "hit rate" in out


def test_cli_no_partial_reuse_is_full_blocks(capsys):
    assert cli.main([*SMALL, "--no-partial-reuse", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "full-blocks"


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    assert cli.main([*SMALL, "--compare", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert cli.main([*SMALL, "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install -e '.[plot]'" in err and "Traceback" not in err


def test_cli_match_and_info_still_work(capsys):
    assert cli.main(["match", "--conversations", "3", "--backend", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] > 0
    assert cli.main(["info", "--backend", "cpu"]) == 0
    assert "backend: cpu" in capsys.readouterr().out


# -- bad input: a clear message, exit status 2, no traceback ---------------------------------------
def bad(capsys, argv, *expected):
    assert cli.main(argv) == 2
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    for e in expected:
        assert e in cap.err, cap.err
    return cap.err


def test_unknown_flag(capsys):
    bad(capsys, ["--bogus"], "unrecognized arguments: --bogus")
    bad(capsys, ["simulate", "--policy", "sometimes"], "--policy", "invalid choice")


def test_bad_numbers(capsys):
    bad(capsys, [*SMALL, "--limit", "-1"], "--limit must be >= 0")
    bad(capsys, [*SMALL, "--pages", "0"], "pages must be an int >= 1")
    bad(capsys, [*SMALL, "--step-ms", "0"], "step-ms must be a positive number")
    bad(capsys, [*SMALL, "--max-running", "x"], "--max-running", "invalid int value")
    bad(capsys, [*SMALL, "--compare", "--policy", "per-page"], "--compare runs both policies")


def test_malformed_trace_line(tmp_path, capsys):
    path = write_trace(tmp_path, [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        '{"timestamp": 1, "input_length": 600,',
    ])
    bad(capsys, ["--trace", str(path), "--backend", "cpu"], f"{path}:2:", "malformed JSON")


def test_trace_lengths_disagree_with_hash_ids(tmp_path, capsys):
    path = write_trace(tmp_path, [{"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1]}])
    bad(capsys, ["simulate", "--trace", str(path), "--backend", "cpu"], f"{path}:1:",
        "input_length 2000 disagrees with 2 hash ids")


def test_missing_trace_file(tmp_path, capsys):
    bad(capsys, ["--trace", str(tmp_path / "nope.jsonl"), "--backend", "cpu"], "nope.jsonl")


def test_the_wall_time_covers_the_whole_run(capsys):
    """Called in-process, the run's wall time is the call's: the warm-up and
    kernel loading included, more than the simulation alone."""
    import time

    t0 = time.perf_counter()
    assert cli.main([*SMALL, "--json"]) == 0
    took = time.perf_counter() - t0
    s = json.loads(capsys.readouterr().out)
    assert 0 < s["simulation_wall_s"] < s["wall_s"] <= took


def test_the_commands_wall_time_starts_with_the_process():
    """Run as the program, the wall time counts from the process's start:
    the interpreter, the imports and the backend choice too."""
    import os
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("GPUKV_BACKEND", "NUMBA_ENABLE_CUDASIM")}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "gpukv.cli", "--limit", "0", "--json", "--no-progress"],
                         env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["requests"] == 0 and s["simulation_wall_s"] < s["wall_s"]
    assert 0.5 * took <= s["wall_s"] <= took + 0.02  # /proc counts in 10 ms ticks
