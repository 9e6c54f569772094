"""The README's scheduler loop runs as written and reuses what it says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def the_loop() -> str:
    use = README.read_text().split("## Use\n", 1)[1]
    return re.search(r"```python\n(.*?)```", use, re.S).group(1)


def test_the_readme_scheduler_loop_runs_on_the_batched_calls():
    code = the_loop()
    for call in ("create_kv_caches", "resume_batch", "resize_batch", "commit_batch", "close_batch", "take_page_copies"):
        assert f"mgr.{call}(" in code
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    claimed = int(re.search(r"# (\d+): ", code).group(1))
    assert int(out.getvalue().strip()) == claimed == 900
    mgr = namespace["mgr"]
    assert not namespace["running"] and not namespace["waiting"]
    from gpukv import introspect

    introspect.check_sanity(mgr)
