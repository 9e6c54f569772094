"""The documentation stands alone in a clone of the repository.

- Every relative link in the Markdown files resolves to a file inside the
  repository, and a link to a heading (``page#anchor``) finds that heading.
- No file (docs, code, tests, benchmarks, configuration) cites a path outside
  the repository, or a Markdown file that the repository does not have: the
  rulebook is ``docs/semantics.md``, cited by that path.
- Every section a file cites from the rulebook (``§2.4``, ``§7.19``) exists there.
- Every python block of README.md, docs/api.md and docs/integration.md runs,
  per file in one namespace, on the cpu backend; a page's fragments are
  completed by a setup block the page itself shows, and a block that cannot
  run here is marked, with the reason, and counted.

Each failure lists ``file:line``, what was found and what to write instead.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # tests/repository/ -> the checkout
RULEBOOK = ROOT / "docs/semantics.md"
MD = ".md"  # test data spells file names with it, so that this file does not cite them
SEC = "§"

# Folders that are not part of the repository's own text: build outputs,
# environments, caches, and reference material some checkouts keep beside
# the code (whatever lies there is not shipped with the project).
NOT_OURS = {
    ".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis",
    ".benchmarks", ".numba_cache", ".whl", ".gl", "shared", "node_modules",
}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".txt", ".sh", ".yml", ".yaml"}


def repository_files(root: Path = ROOT) -> list[Path]:
    """The text files of the repository: known suffixes, and scripts (``#!``).
    Folders that are not ours are pruned, not walked (a ``.venv`` is large)."""
    out = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in NOT_OURS and not d.endswith(".egg-info"))
        for name in sorted(names):
            path = Path(folder) / name
            if path.suffix in TEXT_SUFFIXES:
                out.append(path)
            elif not path.suffix and path.is_file():
                with path.open("rb") as f:
                    if f.read(2) == b"#!":
                        out.append(path)
    return out


def _ours_under(root: Path, path: Path) -> bool:
    parts = path.relative_to(root).parts
    return not any(p in NOT_OURS or p.endswith(".egg-info") for p in parts)


@functools.lru_cache(maxsize=None)
def documents_by_name(root: Path) -> dict[str, tuple[str, ...]]:
    """Each Markdown file name of the repository -> the paths that have it."""
    out: dict[str, list[str]] = {}
    for doc in repository_files(root):
        if doc.suffix == ".md":
            out.setdefault(doc.name, []).append(_rel(doc, root))
    return {name: tuple(paths) for name, paths in out.items()}


def _rel(path: Path, root: Path = ROOT) -> str:
    return path.relative_to(root).as_posix()


# -- Markdown ---------------------------------------------------------------------------
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str):
    """``(line number, line)`` outside fenced code blocks, inline code removed."""
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield no, INLINE_CODE.sub("", line)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the rendered text, lower case,
    without punctuation, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            s = slug(m.group(2))
            k = seen.get(s, 0)
            seen[s] = k + 1
            out.add(s if k == 0 else f"{s}-{k}")
    return out


def link_problems(md: Path, root: Path = ROOT) -> list[str]:
    """Relative links of ``md`` that do not resolve inside ``root``."""
    problems = []
    text = md.read_text(encoding="utf-8")
    for no, line in prose_lines(text):
        targets = [m.group(1) for m in LINK.finditer(line)]
        m = REF_DEF.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            if SCHEME.match(target) or target.startswith("//"):
                continue  # a web address
            where = f"{_rel(md, root)}:{no}: link ({target})"
            path_part, _, anchor = target.partition("#")
            dest = (md.parent / path_part).resolve() if path_part else md
            try:
                dest.relative_to(root)
            except ValueError:
                problems.append(f"{where} leaves the repository; link a file under {root.name}/ instead")
                continue
            if not _ours_under(root, dest) or not dest.exists():
                problems.append(f"{where}: no such file in the repository")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: {_rel(dest, root)} has no heading with anchor #{anchor}")
    return problems


# -- paths outside the repository ----------------------------------------------------------
# The patterns are spelled with a character class ("w[o]rk") so that this file,
# which is scanned like every other, does not match itself.
PATH_TAIL = r"[^\s`'\"<>()\[\],;]*"
OUTSIDE = [
    (re.compile(r"/w[o]rk/" + PATH_TAIL), "an absolute path on one machine; cite the file's path in the repository"),
    (re.compile(r"\.\./sh[a]red" + PATH_TAIL), "a folder beside the checkout, which a clone does not have"),
    (re.compile(r"sh[a]red/docs" + PATH_TAIL), "reference material outside the repository; cite docs/semantics.md"),
    (re.compile(r"sh[a]red docs", re.IGNORECASE), "reference material outside the repository; cite docs/semantics.md"),
    (re.compile(r"\bsemantics [§]"), "say which file: docs/semantics.md §..."),
]
URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
MD_MENTION = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*[\w-]+(?:/[\w.-]+)*\.md)\b")


def _resolves(path_text: str, source: Path, root: Path) -> bool:
    for base in (source.parent, root):
        dest = (base / path_text).resolve()
        try:
            dest.relative_to(root)
        except ValueError:
            continue
        if dest.is_file() and _ours_under(root, dest):
            return True
    return False


def outside_citations(path: Path, root: Path = ROOT) -> list[str]:
    """Lines of ``path`` that cite a path outside the repository, or a Markdown
    file by a path that does not resolve (relative to the file or to the root).

    In code, an unresolved ``*.md`` name counts only when the repository has a
    document of that name elsewhere (a bare name of a file in ``docs/``):
    other names there are files a program writes, not citations."""
    docs_by_name = documents_by_name(root)
    problems = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{_rel(path, root)}:{no}"
        taken: list[range] = []  # one report per stretch of text, the first pattern's
        for pattern, why in OUTSIDE:
            for m in pattern.finditer(line):
                if any(m.start() in r or r.start in range(m.start(), m.end()) for r in taken):
                    continue
                taken.append(range(m.start(), m.end()))
                found = m.group(0).rstrip(".:")
                known = docs_by_name.get(Path(found).name) if found.endswith(MD) else None
                fix = f"; write {' or '.join(known)}" if known else ""
                problems.append(f"{where}: {found!r}: {why}{fix}")
        for m in MD_MENTION.finditer(URL.sub("", line)):
            name = m.group(1)
            if _resolves(name, path, root):
                continue
            known = docs_by_name.get(Path(name).name)
            if known:
                problems.append(f"{where}: {name!r} does not resolve from here; write {' or '.join(known)}")
            elif path.suffix == ".md":
                problems.append(f"{where}: {name!r} is not a file of the repository")
    return problems


# -- sections of the rulebook -------------------------------------------------------------------
SECTION_REF = re.compile(r"§\s*(\d+(?:\.\d+)*)((?:\s*[-–/]\s*§?\s*\d+(?:\.\d+)*)*)")
NUMBERED_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)\.?\s")
NUMBERED_ITEM = re.compile(r"^(\d+)\.\s")


def rulebook_sections(rulebook: Path = RULEBOOK) -> set[str]:
    """Numbered headings (``2.5.1``) and, under each, its numbered items
    (``3.15``: invariant 15, ``7.19``: pitfall 19)."""
    out = set()
    current = None
    fenced = False
    for line in rulebook.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        if HEADING.match(line):
            m = NUMBERED_HEADING.match(line)
            current = m.group(1) if m else None
            if current:
                out.add(current)
        elif current:
            m = NUMBERED_ITEM.match(line)
            if m:
                out.add(f"{current}.{m.group(1)}")
    return out


def cites_rulebook(text: str) -> bool:
    return RULEBOOK.name in text or re.search(r"\bsemantics [§]", text) is not None


def section_problems(path: Path, sections: set[str], root: Path = ROOT) -> list[str]:
    """§ references of a file that cites the rulebook, to sections it lacks."""
    text = path.read_text(encoding="utf-8")
    if not cites_rulebook(text):
        return []
    problems = []
    for no, line in enumerate(text.splitlines(), 1):
        for m in SECTION_REF.finditer(line):
            numbers = [m.group(1)] + re.findall(r"\d+(?:\.\d+)*", m.group(2))
            for n in numbers:
                if n not in sections:
                    problems.append(f"{_rel(path, root)}:{no}: §{n} is not a section of docs/semantics.md")
    return problems


# -- the tests ------------------------------------------------------------------------------------
FILES = repository_files()
MARKDOWN = [p for p in FILES if p.suffix == ".md"]
CITING = [p for p in FILES if cites_rulebook(p.read_text(encoding="utf-8"))]


def test_the_rulebook_and_the_readme_are_in_the_repository():
    assert RULEBOOK.is_file()
    assert ROOT / "README.md" in MARKDOWN
    assert RULEBOOK in MARKDOWN


@pytest.mark.parametrize("md", MARKDOWN, ids=[_rel(p) for p in MARKDOWN])
def test_every_relative_link_resolves_inside_the_repository(md):
    problems = link_problems(md)
    assert not problems, "\n" + "\n".join(problems)


@pytest.mark.parametrize("path", FILES, ids=[_rel(p) for p in FILES])
def test_no_file_cites_a_path_outside_the_repository(path):
    problems = outside_citations(path)
    assert not problems, "\n" + "\n".join(problems)


@pytest.mark.parametrize("path", CITING, ids=[_rel(p) for p in CITING])
def test_every_cited_section_exists_in_the_rulebook(path):
    problems = section_problems(path, rulebook_sections())
    assert not problems, "\n" + "\n".join(problems)


def test_the_rulebook_keeps_the_sections_the_code_cites():
    sections = rulebook_sections()
    expected = {f"1.{i}" for i in range(1, 8)} | {f"2.{i}" for i in range(1, 12)}
    expected |= {"2.5.1", "2.5.2", "2.5.3", "3", "4", "5", "6.1", "6.2", "6.3", "6.4", "7", "8"}
    expected |= {f"3.{i}" for i in range(1, 17)} | {f"7.{i}" for i in range(1, 24)}
    assert expected <= sections, sorted(expected - sections)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """Each check, on a small repository with one mistake of each kind."""
    (tmp_path / "docs").mkdir()
    rules = tmp_path / "docs" / f"semantics{MD}"
    rules.write_text("# Rules\n\n## 2. Operations\n\n### 2.4 Pruning\n\n## 7. Pitfalls\n\n1. one\n2. two\n")
    readme = tmp_path / f"README{MD}"
    readme.write_text(
        f"[ok](docs/semantics{MD}) [anchor](docs/semantics{MD}#24-pruning) [web](https://example.com/x{MD})\n"
        f"[missing](docs/nothing{MD}) [bad anchor](docs/semantics{MD}#25-commits) [out](../elsewhere{MD})\n"
        f"`[in code](nowhere{MD})`\n"
    )
    problems = link_problems(readme, tmp_path)
    assert len(problems) == 3, problems
    assert "docs/nothing" in problems[0] and "#25-commits" in problems[1] and "leaves the repository" in problems[2]

    code = tmp_path / "mod.py"
    away = "/w" + "ork/x/docs/semantics" + MD
    code.write_text(f'"""Rules: semantics{MD} {SEC}2.4; {away}; docs/semantics{MD} {SEC}7.2."""\n# semantics {SEC}2.3\n')
    found = outside_citations(code, tmp_path)
    assert len(found) == 3, found
    assert "mod.py:1" in found[0] and "absolute path" in found[0]
    assert "mod.py:1" in found[1] and f"write docs/semantics{MD}" in found[1]
    assert "mod.py:2" in found[2] and "say which file" in found[2]
    writer = tmp_path / "writer.py"
    writer.write_text(f"out = 'report{MD}'  # a file the program writes\n")
    assert outside_citations(writer, tmp_path) == []
    readme.write_text(f"See report{MD} and semantics{MD}.\n")
    assert [p.split(": ", 2)[1] for p in outside_citations(readme, tmp_path)] == [
        f"'report{MD}' is not a file of the repository",
        f"'semantics{MD}' does not resolve from here; write docs/semantics{MD}",
    ]

    sections = rulebook_sections(rules)
    assert sections == {"2", "2.4", "7", "7.1", "7.2"}
    assert section_problems(code, sections, tmp_path) == [f"mod.py:2: {SEC}2.3 is not a section of docs/semantics{MD}"]
    code.write_text(f"# docs/semantics{MD} {SEC}2.4-2.5 and {SEC}7.2/{SEC}7.3\n")
    assert [p.split(": ", 1)[1] for p in section_problems(code, sections, tmp_path)] == [
        f"{SEC}2.5 is not a section of docs/semantics{MD}",
        f"{SEC}7.3 is not a section of docs/semantics{MD}",
    ]


# -- the code blocks of the guides run ------------------------------------------------------------
# Every fenced ``python`` block of these files runs, per file, in one namespace,
# in the order of the file, on the cpu backend. A comment line right before a
# block marks it:
#   <!-- docs-test: preamble -->        runs before every other block of the file
#                                        (the setup a page's fragments assume, shown in the page)
#   <!-- docs-test: skip: REASON -->    does not run here (it needs a GPU, PyTorch, a network)
RUNNABLE_DOCS = ("README.md", "docs/api.md", "docs/integration.md")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(preamble|skip)\s*(?::\s*(.*?))?\s*-->\s*$")
PY_FENCE = re.compile(r"^\s*```python\s*$")


def code_blocks(text: str) -> list[dict]:
    """The fenced python blocks of a Markdown text: each with its first line
    number, its code, and its mark (None, ``preamble`` or ``skip``) and reason."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not PY_FENCE.match(lines[i]):
            if FENCE.match(lines[i]):  # another language's block: step over it whole
                i += 1
                while i < len(lines) and not FENCE.match(lines[i]):
                    i += 1
            i += 1
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        m = MARKER.match(lines[j]) if j >= 0 else None
        start = i + 1
        i += 1
        while i < len(lines) and not FENCE.match(lines[i]):
            i += 1
        if i == len(lines):
            raise ValueError(f"line {start}: a python block is never closed")
        if m and m.group(1) == "skip" and not m.group(2):
            raise ValueError(f"line {j + 1}: a skipped block must say why (docs-test: skip: REASON)")
        blocks.append({"line": start + 1, "code": "\n".join(lines[start:i]) + "\n",
                       "mark": m.group(1) if m else None, "reason": m.group(2) if m else None})
        i += 1
    return blocks


def run_blocks(path: Path, blocks: list[dict]) -> list[tuple[int, str]]:
    """Runs a file's blocks in one namespace (preambles first); the skipped
    ones, as ``(line, reason)``. A failing block raises, naming its line."""
    namespace: dict = {"__name__": "__docs__"}
    order = [b for b in blocks if b["mark"] == "preamble"] + [b for b in blocks if b["mark"] is None]
    for b in order:
        code = compile("\n" * (b["line"] - 1) + b["code"], str(path), "exec")  # tracebacks name the doc's lines
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(code, namespace)
        except Exception as e:
            where = _rel(path) if path.is_relative_to(ROOT) else path.name
            raise AssertionError(f"{where}:{b['line']}: the block fails: {type(e).__name__}: {e}") from e
    return [(b["line"], b["reason"]) for b in blocks if b["mark"] == "skip"]


# How many blocks each guide leaves out: a new one is a decision, stated here too.
SKIPPED_BLOCKS = {"README.md": 0, "docs/api.md": 1, "docs/integration.md": 3}


@pytest.mark.parametrize("doc", RUNNABLE_DOCS)
def test_every_python_block_of_the_guides_runs(doc, monkeypatch):
    monkeypatch.setenv("GPUKV_BACKEND", "cpu")
    path = ROOT / doc
    blocks = code_blocks(path.read_text(encoding="utf-8"))
    assert any(b["mark"] is None for b in blocks), f"{doc} has no block the test runs"
    skipped = run_blocks(path, blocks)
    ran = sum(b["mark"] != "skip" for b in blocks)
    report = f"{doc}: {ran} blocks ran, {len(skipped)} skipped" + "".join(f"\n  line {n}: {why}" for n, why in skipped)
    print(report)
    assert len(skipped) == SKIPPED_BLOCKS[doc], report


def test_the_block_runner_runs_preambles_first_and_names_a_failing_line(tmp_path):
    doc = tmp_path / f"guide{MD}"
    doc.write_text(
        "Text.\n\n```python\nx = base + 1\n```\n\n```bash\nnot python\n```\n\n"
        "<!-- docs-test: skip: needs a GPU -->\n```python\nimport cupy\n```\n\n"
        "<!-- docs-test: preamble -->\n```python\nbase = 41\n```\n\n```python\nassert x == 42\ny = z\n```\n"
    )
    blocks = code_blocks(doc.read_text())
    assert [(b["line"], b["mark"]) for b in blocks] == [(4, None), (13, "skip"), (18, "preamble"), (22, None)]
    with pytest.raises(AssertionError, match=r"guide\.md:22: the block fails: NameError: name 'z'"):
        run_blocks(doc, blocks)
    blocks[-1]["code"] = "assert x == 42\n"
    assert run_blocks(doc, blocks) == [(13, "needs a GPU")]
    with pytest.raises(ValueError, match="must say why"):
        code_blocks("<!-- docs-test: skip -->\n```python\npass\n```\n")
