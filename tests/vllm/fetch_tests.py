"""Fetch vLLM's scheduler tests (``tests/v1/core/``) from its source distribution.

The tests ship only in the sdist on the package index, not in the wheel, and
``pip download`` cannot fetch that sdist: it insists on building the package's
metadata, which vLLM's build cannot do without CUDA.  So this script asks pip's
own finder for the sdist's link (the index's simple page gives its sha256),
downloads it with pip's session (same proxy/certificate settings as pip), keeps
it in a cache folder, verifies the hash, and extracts:

* every file under ``tests/v1/core/``;
* every module of the sdist's ``tests/`` tree that those files import,
  followed transitively (``from tests.utils import ...`` and the like);
* the ``__init__.py`` of every package folder on the way, so that
  ``tests.v1.core.test_x`` imports as a package module.

Usage::

    python fetch_tests.py TARGET_DIR [--version 0.33.0] [--cache DIR]

Afterwards ``TARGET_DIR/tests/v1/core/`` holds the tests.  The cache defaults
to ``${XDG_CACHE_HOME:-~/.cache}/gpukv-vllm/``; a cached file whose hash
matches is used without touching the network.  Re-running is cheap: a stamp
in ``TARGET_DIR/tests/`` records the sdist's hash and the extracted files, and
extraction is skipped while they are all there.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import sys
import tarfile
import tempfile

PACKAGE = "vllm"
DEFAULT_VERSION = "0.33.0"
CORE = "tests/v1/core/"


def cache_dir(explicit: str | None) -> str:
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpukv-vllm")


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_settings() -> dict[str, str]:
    """pip's effective configuration (files, then PIP_* variables), later wins."""
    from pip._internal.configuration import Configuration

    conf = Configuration(isolated=False)
    try:
        conf.load()
    except Exception:  # a broken pip.conf should not stop us; defaults apply
        return {}
    out: dict[str, str] = {}
    for key, value in conf.items():
        # pip < 24: ("section.name", value); newer pip: (file, {"section.name": value})
        pairs = value.items() if isinstance(value, dict) else [(key, value)]
        for name, val in pairs:
            out[name.split(".", 1)[-1]] = val
    return out


def find_sdist(name: str, version: str):
    """(url, filename, sha256) of the sdist of name==version on the primary index."""
    from pip._internal.index.collector import LinkCollector
    from pip._internal.index.package_finder import PackageFinder
    from pip._internal.models.index import PyPI
    from pip._internal.models.search_scope import SearchScope
    from pip._internal.models.selection_prefs import SelectionPreferences
    from pip._internal.network.session import PipSession

    settings = pip_settings()
    index_url = os.environ.get("GPUKV_VLLM_INDEX_URL") or settings.get("index-url") or PyPI.simple_url
    session = PipSession(retries=3)
    session.timeout = float(settings.get("default-timeout") or settings.get("timeout") or 60)
    cert = settings.get("cert")
    if cert:
        session.verify = cert
    # Only the primary index: the sdist is on PyPI; local find-links/extra
    # indexes hold wheels at most.
    scope = SearchScope.create(find_links=[], index_urls=[index_url], no_index=False)
    finder = PackageFinder.create(
        link_collector=LinkCollector(session=session, search_scope=scope),
        selection_prefs=SelectionPreferences(allow_yanked=False),
    )
    found = [
        c for c in finder.find_all_candidates(name)
        if str(c.version) == version and c.link.filename.endswith(".tar.gz")
    ]
    if not found:
        raise SystemExit(f"fetch_tests: no sdist of {name}=={version} on {index_url}")
    link = found[0].link
    if link.hash_name != "sha256" or not link.hash:
        raise SystemExit(f"fetch_tests: the index gives no sha256 for {link.filename}")
    return session, link.url.split("#", 1)[0], link.filename, link.hash


def ensure_sdist(version: str, cache: str) -> tuple[str, str]:
    """Path and sha256 of the cached sdist, downloading it when absent or
    damaged. The recorded hash is the index's, so a cached file is checked
    without the network."""
    os.makedirs(cache, exist_ok=True)
    filename = f"{PACKAGE}-{version}.tar.gz"
    path = os.path.join(cache, filename)
    stamp = path + ".sha256"
    if os.path.exists(path) and os.path.exists(stamp):
        with open(stamp) as f:
            want = f.read().strip()
        if sha256_of(path) == want:
            return path, want
    session, url, index_name, want = find_sdist(PACKAGE, version)
    if index_name != filename:
        path = os.path.join(cache, index_name)
        stamp = path + ".sha256"
    if not (os.path.exists(path) and sha256_of(path) == want):
        print(f"fetch_tests: downloading {url}", file=sys.stderr)
        resp = session.get(url, stream=True)
        resp.raise_for_status()
        h = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in resp.iter_content(1 << 20):
                    h.update(chunk)
                    f.write(chunk)
            if h.hexdigest() != want:
                raise SystemExit(f"fetch_tests: sha256 mismatch for {index_name}: "
                                 f"got {h.hexdigest()}, index says {want}")
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    with open(stamp, "w") as f:
        f.write(want + "\n")
    return path, want


def tests_imports(source: bytes, module: str) -> set[str]:
    """Dotted names under ``tests`` that a module imports (absolute or relative)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    pkg = module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            # "from tests.x import y" may import a submodule y
            names.update(f"{mod}.{a.name}" for a in node.names)
    return {n for n in names if n == "tests" or n.startswith("tests.")}


def select_members(tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """Map of sdist-relative path -> member for the files to extract."""
    root = None
    files: dict[str, tarfile.TarInfo] = {}
    for m in tar.getmembers():
        if not m.isfile():
            continue
        top, _, rel = m.name.partition("/")
        root = root or top
        if top == root and rel.startswith("tests/"):
            files[rel] = m
    wanted = {rel for rel in files if rel.startswith(CORE)}
    queue = [rel for rel in wanted if rel.endswith(".py")]
    while queue:
        rel = queue.pop()
        module = rel[:-3].replace("/", ".")  # tests.a.__init__ keeps pkg tests.a
        data = tar.extractfile(files[rel]).read()
        for name in tests_imports(data, module):
            path = name.replace(".", "/")
            for cand in (path + ".py", path + "/__init__.py"):
                if cand in files and cand not in wanted:
                    wanted.add(cand)
                    queue.append(cand)
    # package __init__.py files of every folder on the way
    for rel in list(wanted):
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            init = "/".join(parts[:i]) + "/__init__.py"
            if init in files:
                wanted.add(init)
    return {rel: files[rel] for rel in sorted(wanted)}


STAMP = os.path.join("tests", ".gpukv-vllm-fetched")


def extract(sdist: str, target: str, sha256: str) -> list[str]:
    """Extract the selected files; skipped when a stamp from the same sdist
    says they are there already."""
    stamp = os.path.join(target, STAMP)
    if os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as f:
            lines = f.read().splitlines()
        if lines and lines[0] == sha256 and all(os.path.exists(os.path.join(target, rel)) for rel in lines[1:]):
            return lines[1:]
    with tarfile.open(sdist, "r:gz") as tar:
        members = select_members(tar)
        written = []
        for rel, m in members.items():
            data = tar.extractfile(m).read()
            dest = os.path.join(target, rel)
            if os.path.exists(dest):
                with open(dest, "rb") as f:
                    if f.read() == data:
                        written.append(rel)
                        continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(data)
            written.append(rel)
    with open(stamp, "w", encoding="utf-8") as f:
        f.write("\n".join([sha256, *written]) + "\n")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="folder to extract tests/ into")
    ap.add_argument("--version", default=DEFAULT_VERSION)
    ap.add_argument("--cache", default=None, help="download cache (default ${XDG_CACHE_HOME:-~/.cache}/gpukv-vllm)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the extracted files")
    args = ap.parse_args(argv)
    sdist, sha256 = ensure_sdist(args.version, cache_dir(args.cache))
    files = extract(sdist, args.target, sha256)
    if args.verbose:
        print("\n".join(files))
    print(f"fetch_tests: {len(files)} files from {os.path.basename(sdist)} in "
          f"{os.path.join(args.target, 'tests')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
