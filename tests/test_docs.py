"""The API reference lists every public name (introspection; no Sphinx run here).

The Sphinx build itself runs with ``make docs`` (warnings are errors), not in the test suite.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_rollout

API_RST = Path(__file__).resolve().parents[1] / "docs" / "api.rst"
# ``.. autoclass:: lightning_rollout.loop.MultiEnvLoop`` (any auto* directive, any module path)
_DIRECTIVE = re.compile(r"^\s*\.\.\s+auto(?:class|exception|function|data|attribute)::\s+([\w.]+)", re.M)


def _documented() -> set[str]:
    text = API_RST.read_text(encoding="utf-8")
    return {target.rsplit(".", 1)[-1] for target in _DIRECTIVE.findall(text)}


def _public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    assert names is not None, f"{module_name} has no __all__"
    return sorted(names)


def test_api_page_exists():
    assert API_RST.is_file(), f"{API_RST} is missing"


@pytest.mark.parametrize("name", sorted(lightning_rollout.__all__))
def test_top_level_name_in_api_reference(name):
    assert name in _documented(), (
        f"lightning_rollout.{name} is public (in __all__) but docs/api.rst has no "
        f"'.. autoclass::' (or autofunction/autoexception/autodata) entry for it")


def test_documented_targets_are_the_exported_objects():
    """Each auto* target in api.rst imports, and a top-level name points at the same object."""
    text = API_RST.read_text(encoding="utf-8")
    for target in _DIRECTIVE.findall(text):
        module_name, _, attr = target.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a guarded section for a part not written yet (``.. if-importable::``)
            continue
        if not hasattr(module, attr):
            continue  # guarded by ``:names:`` in api.rst
        if attr in lightning_rollout.__all__:
            assert getattr(module, attr) is getattr(lightning_rollout, attr), target


def test_lightning_names_in_api_reference():
    try:
        names = _public_names("lightning_rollout.lightning")
    except (ImportError, AssertionError) as exc:  # the Lightning layer is optional / not there yet
        pytest.skip(f"lightning_rollout.lightning not available: {exc}")
    missing = [n for n in names if n not in _documented()]
    assert not missing, f"lightning_rollout.lightning names missing from docs/api.rst: {missing}"


# -- the docs' Python code runs as a script (issue 13 item 6, issue item E2) --------------------------------------------
#
# Every page's code runs as a script, as written: the Python blocks of README.md and of each docs/*.rst page,
# concatenated in order as a reader pastes them into one file, are written to a scratch folder and run there by this
# interpreter (the venv's python) in a process of their own. So a block that starts processes (``ParallelEnv``,
# ``num_workers > 1``: ``spawn`` imports the script again in each child) must guard its work with
# ``if __name__ == "__main__":``, as a real script must, and the page's unguarded work runs again in every child.
# Python blocks: ```python fences in the README; ``.. code-block:: python`` (also ``code`` / ``sourcecode``),
# ``.. testsetup::`` and ``.. testcode::`` (sphinx.ext.doctest) in the pages. Blocks that are not meant to run are
# ``console`` / ``text`` blocks, and every block names its language.

REPO = Path(__file__).resolve().parents[1]
DOC_PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.rst"))]
_PYTHON = {"python", "py", "python3"}
_RST_BLOCK = re.compile(r"^(?P<indent> *)\.\. (?:(?P<code>code-block|code|sourcecode)::(?P<lang>[^\n]*)"
                        r"|(?P<doctest>testsetup|testcode)::[^\n]*)\n")
_FENCE = re.compile(r"^```(?P<lang>[^\n`]*)\n(?P<body>.*?)^```\s*$", re.M | re.S)


def _rst_blocks(text: str) -> list[tuple[int, str | None, str]]:
    """(line, language, code) of every code directive of an rst page; language ``None`` when it names none."""
    lines = text.splitlines()
    blocks = []
    for number, line in enumerate(lines):
        match = _RST_BLOCK.match(line + "\n")
        if not match:
            continue
        indent = len(match["indent"])
        lang = "python" if match["doctest"] else (match["lang"].strip() or None)
        body: list[str] = []
        i = number + 1
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" " * (indent + 1))):
            body.append(lines[i])
            i += 1
        body_start = next((k for k, b in enumerate(body) if not b.strip().startswith(":") and b.strip()), len(body))
        code = body[body_start:]  # options (``:skipif:``, ``:caption:``...) and the blank line left out
        width = min((len(b) - len(b.lstrip()) for b in code if b.strip()), default=0)
        blocks.append((number + 1 + body_start + 1, lang, "\n".join(b[width:] for b in code).rstrip() + "\n"))
    return blocks


def _markdown_blocks(text: str) -> list[tuple[int, str | None, str]]:
    return [(text[:m.start()].count("\n") + 2, m["lang"].strip() or None, m["body"]) for m in _FENCE.finditer(text)]


def doc_blocks(page: str) -> list[tuple[int, str | None, str]]:
    """(first line of the code, language, code) of every code block of ``page`` (a path relative to the repo)."""
    text = (REPO / page).read_text(encoding="utf-8")
    return _markdown_blocks(text) if page.endswith(".md") else _rst_blocks(text)


def python_blocks(page: str) -> list[tuple[int, str]]:
    return [(line, code) for line, lang, code in doc_blocks(page) if lang in _PYTHON]


def test_snippets_are_found():
    """The extraction sees the blocks it should (a regression here would silently skip pages)."""
    assert len(python_blocks("README.md")) >= 2
    assert len(python_blocks("docs/lightning.rst")) >= 5
    assert [lang for _, lang, _ in doc_blocks("docs/getting_started.rst")][:2] == ["console", "console"]


@pytest.mark.parametrize("page", DOC_PAGES)
def test_every_code_block_names_its_language(page):
    unnamed = [line for line, lang, _ in doc_blocks(page) if lang is None]
    assert not unnamed, (f"{page}: code blocks at lines {unnamed} name no language; use python (it is run by this "
                         "test), or console / text for what is not meant to run")


# The one change made to a block before it runs: the Lightning guide's complete example trains to the 475 bar
# (48,640 frames, 40 s or more of a 2-core machine); here it runs on a small budget, as test_lightning_habits.py runs it.
BUDGETS = {("docs/lightning.rst", "TOTAL_FRAMES"): "4 * 1024"}


def runnable(page: str, code: str) -> str:
    for (budget_page, name), value in BUDGETS.items():
        if budget_page == page:
            code = re.sub(rf"^{name} = .*$", f"{name} = {value}", code, flags=re.M)
    return code


SCRIPT_TIMEOUT_S = 240  # a page's script, its child processes included


def page_script(page: str) -> str:
    """The page's Python blocks as one script, in order; each block starts at its own line of the page (blank lines
    between blocks), so a traceback's line numbers are the page's."""
    lines = [f"# The Python blocks of {page}, each at its line of the page (tests/test_docs.py)."]
    for line, code in python_blocks(page):
        assert len(lines) < line, (page, line)  # blocks come in page order and never overlap
        lines += [""] * (line - 1 - len(lines)) + runnable(page, code).rstrip("\n").split("\n")
    return "\n".join(lines) + "\n"


def test_page_script_keeps_the_page_lines():
    script = page_script("README.md").split("\n")
    text = (REPO / "README.md").read_text(encoding="utf-8").split("\n")
    for line, code in python_blocks("README.md"):
        first = code.split("\n")[0]
        assert script[line - 1] == text[line - 1] == first, line


SCRIPT_PAGES = [p for p in DOC_PAGES if python_blocks(p)]
# Scripts run side by side, this many at a time (each is mostly one core's work: a fresh interpreter importing torch,
# TorchRL and Lightning, then small training runs), the longest first; the tests then read their results in order.
SCRIPT_JOBS = max(1, min(2, os.cpu_count() or 1))


def run_page_script(page: str, folder: Path) -> str | None:
    """Run ``page``'s script in ``folder``; ``None`` when it exits with 0, else what went wrong (its output's end)."""
    # never a module's name: a script named torchrl.py or lightning.py would shadow the package it imports
    script = folder / f"page_{re.sub(r'[^0-9A-Za-z]+', '_', page)}.py"
    script.write_text(page_script(page), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        output = [x.decode(errors="replace") if isinstance(x, bytes) else x for x in (exc.stdout, exc.stderr) if x]
        return f"{page} as a script ran past {SCRIPT_TIMEOUT_S} s; its output:\n" + "\n".join(output)[-6000:]
    if done.returncode:
        return (f"{page} as a script ({script}) exited with {done.returncode} (its line numbers are the page's):\n"
                f"{done.stderr[-6000:]}")
    return None


@pytest.fixture(scope="module")
def page_scripts(request, tmp_path_factory):
    """The selected pages' scripts, started side by side (``SCRIPT_JOBS`` at a time): ``{page: future}``."""
    from concurrent.futures import ThreadPoolExecutor

    selected = {item.callspec.params["page"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_page_runs_as_a_script"}
    pages = sorted(selected, key=lambda page: -len(page_script(page)))  # the longest first
    with ThreadPoolExecutor(max_workers=SCRIPT_JOBS) as pool:
        yield {page: pool.submit(run_page_script, page, tmp_path_factory.mktemp("page")) for page in pages}


@pytest.mark.timeout(len(SCRIPT_PAGES) * SCRIPT_TIMEOUT_S)
@pytest.mark.parametrize("page", SCRIPT_PAGES)
def test_page_runs_as_a_script(page, page_scripts):
    """The page's Python blocks, concatenated in order, run as one script (``python script.py``) in a scratch
    folder of their own, sharing nothing with this test process but the environment."""
    problem = page_scripts[page].result()
    assert problem is None, problem


def test_budgets_name_real_lines():
    for (page, name), _ in BUDGETS.items():
        assert any(re.search(rf"^{name} = ", code, re.M) for _, code in python_blocks(page)), (page, name)


def test_benchmark_tables_render_as_tables():
    """docs/performance.rst shows a recorded docs/bench/<group>/table.md as reST tables, not as a Markdown listing."""
    pytest.importorskip("sphinx")
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_conf", REPO / "docs" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    text = (REPO / "docs" / "bench" / "cheap" / "table.md").read_text(encoding="utf-8")
    rst = conf._markdown_to_rst(text)
    assert rst is not None, "a table of docs/bench/cheap/table.md does not parse"
    separators = [ln for ln in text.splitlines() if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", ln.strip())]
    assert sum(ln == ".. list-table::" for ln in rst) == len(separators) > 0
    headings = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert sum(ln.startswith(".. rubric:: ") for ln in rst) == len(headings)
    assert not any(ln.startswith("|") for ln in rst)
    assert ".. rubric:: Cheap env: CartPole, MLP 4-64-64-2, 8 envs" in rst
    assert "   * - ours \\\\ peer" in rst  # a backslash survives reST escaping
