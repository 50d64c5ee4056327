"""Sphinx configuration for the lightning_rollout documentation.

Built by ``make docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``):
every warning is an error. The build never touches the network: no intersphinx
mapping is configured (``sphinx.ext.intersphinx`` is deliberately not loaded), and
the theme (furo) ships its own assets.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

# Import the package from the working tree even when it is not installed.
sys.path.insert(0, os.path.abspath(".."))

import lightning_rollout  # noqa: E402

project = "lightning_rollout"
author = "lightning_rollout contributors"
copyright = "lightning_rollout contributors"
release = lightning_rollout.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",  # ``testsetup`` / ``testcode`` blocks (tests/test_docs.py runs them with the rest)
]

# ``::`` literal blocks are not Python: the Python of these pages is in ``code-block:: python`` (or
# ``testcode``) blocks, which tests/test_docs.py runs; console sessions and output listings say so.
highlight_language = "text"

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []
html_static_path: list[str] = []

html_theme = "furo"
html_title = f"lightning_rollout {release}"

# -- autodoc / napoleon ------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_default_options = {"show-inheritance": True}
autodoc_typehints = "signature"
# autodoc_preserve_defaults re-parses the source files and fails ("pop from empty list") when a
# module is edited between import and parse; defaults are shown by their repr instead.
autodoc_preserve_defaults = False
autoclass_content = "class"  # the class docstring documents the constructor (Google style "Args:")

napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections become :ivar: fields instead of ``.. attribute::`` directives, so a
# dataclass field described in the docstring is not declared twice (a duplicate-object warning).
napoleon_use_ivar = True
napoleon_use_rtype = False

_log = logging.getLogger(__name__)

# A docstring line followed by an underline of "-" / "=" / "~" (an RST section title) cannot
# be nested inside an autodoc directive; module docstrings in lightning_rollout use them
# (e.g. ``lightning_rollout.loop``). They are turned into rubrics.
_UNDERLINE = re.compile(r"^([-=~^\"'`#*+])\1{2,}\s*$")


def _titles_to_rubrics(app, what, name, obj, options, lines):  # noqa: ARG001 (Sphinx signature)
    i = 0
    while i < len(lines) - 1:
        title, under = lines[i], lines[i + 1]
        if title.strip() and not title.startswith(" ") and _UNDERLINE.match(under) and \
                len(under.strip()) >= len(title.strip()):
            lines[i:i + 2] = [f".. rubric:: {title.strip()}", ""]
        i += 1


class IfImportable(SphinxDirective):
    """``.. if-importable:: module.name``: parse the content only when the module imports.

    Option ``:names: A, B``: also require these attributes of the module (a package
    directory may exist, as a namespace package, before its ``__init__`` does).

    Parts of the package are written in parallel (the TorchRL collector, the Lightning
    layer); an autodoc directive for a module that is not there yet would be a build
    warning, hence an error under ``-W``. When the import fails, a short note is rendered
    instead and the reason is logged (not as a warning).
    """

    required_arguments = 1
    has_content = True
    option_spec = {"missing": directives.unchanged, "names": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        module = self.arguments[0]
        try:
            mod = importlib.import_module(module)
            absent = [n.strip() for n in self.options.get("names", "").split(",")
                      if n.strip() and not hasattr(mod, n.strip())]
            if absent:
                raise ImportError(f"{module} has no {', '.join(absent)} yet")
        except Exception as exc:  # ImportError, or a module that fails while it is being written
            _log.info("if-importable: %s not importable (%s: %s); its section is replaced by a note",
                      module, type(exc).__name__, exc)
            text = self.options.get("missing") or (
                f"``{module}`` is not available in this build; its reference appears here once it is.")
            container = nodes.container()
            self.state.nested_parse(StringList([f".. note:: {text}"], source=self.env.docname),
                                    self.content_offset, container)
            return container.children
        container = nodes.container()
        self.state.nested_parse(self.content, self.content_offset, container)
        return container.children


_CODE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _inline(text: str) -> str:
    """Markdown inline text as reST: backslashes kept, ```code``` as a literal."""
    return _CODE.sub(r"``\1``", text.replace("\\", "\\\\"))


def _markdown_table_to_rst(text: str) -> list[str] | None:
    """A GitHub-style pipe table (the ``make bench`` output) as a ``list-table``; None if not one."""
    rows = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(rows) < 2 or not re.fullmatch(r"\|?[\s:|-]+\|?", rows[1]):
        return None

    def cells(line: str) -> list[str]:
        parts = [c.strip() for c in line.strip().strip("|").split("|")]
        return [_inline(c) if c not in ("", "-") else "—" for c in parts]  # a lone "-" would be a bullet

    header, body = cells(rows[0]), [cells(r) for r in rows[2:]]
    if any(len(r) != len(header) for r in body):
        return None
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in [header, *body]:
        out.append(f"   * - {row[0]}")
        out.extend(f"     - {c}" for c in row[1:])
    return out


def _markdown_to_rst(text: str) -> list[str] | None:
    """The Markdown that ``make bench`` writes (headings, paragraphs, pipe tables) as reST lines.

    ``##`` headings and below become rubrics (the page's own sections stay the only
    sections; the ``#`` title is left out), each run of ``|`` lines a ``list-table`` (an
    empty or ``-`` cell shows as a dash), other lines paragraphs. None when a table does not
    parse (the caller then shows the text verbatim).
    """
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if not line:
            i += 1
            continue
        if line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].strip().startswith("|"):
                j += 1
            table = _markdown_table_to_rst("\n".join(lines[i:j]))
            if table is None:
                return None
            out += table + [""]
            i = j
            continue
        heading = _HEADING.match(line)
        if heading:
            if len(heading.group(1)) > 1:  # the file's own title (#) is the page's section title
                out += [f".. rubric:: {_inline(heading.group(2))}", ""]
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].strip() and not lines[j].strip().startswith(("|", "#")):
            out.append(_inline(lines[j].strip()))
            j += 1
        out.append("")
        i = j
    return out


class BenchResults(SphinxDirective):
    """``.. bench-results:: ../benchmarks/results``: the tables and plots written by ``make bench``.

    Renders ``table.md`` (Markdown headings, paragraphs and pipe tables, as rubrics,
    paragraphs and tables; verbatim if a table does not parse) and every ``*.png`` /
    ``*.svg`` of that folder, when present. When the folder holds no results, the
    directive's content (how to produce them) is rendered instead. The build never
    fails because the benchmarks were not run.
    """

    required_arguments = 1
    has_content = True

    def run(self) -> list[nodes.Node]:
        rel = self.arguments[0]
        folder = os.path.normpath(os.path.join(self.env.srcdir, rel))
        shown = os.path.relpath(folder, os.path.dirname(self.env.srcdir))
        table = os.path.join(folder, "table.md")
        lines: list[str] = []
        if os.path.isfile(table):
            self.env.note_dependency(table)
            with open(table, encoding="utf-8") as f:
                text = f.read()
            converted = _markdown_to_rst(text)
            if converted is None:
                lines += ["::", ""] + ["   " + ln for ln in text.splitlines()] + [""]
            else:
                lines += converted
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith((".png", ".svg")):
                    lines += [f".. figure:: {rel}/{name}", "   :width: 100%", "",
                              f"   ``{shown}/{name}``", ""]
        container = nodes.container()
        if lines:
            self.state.nested_parse(StringList(lines, source=self.env.docname), self.content_offset, container)
        else:
            self.state.nested_parse(self.content, self.content_offset, container)
        return container.children


def _always_reread(app, env, added, changed, removed):  # noqa: ARG001
    # Pages whose content depends on files outside docs/ that may appear between builds.
    return [d for d in ("performance", "training", "api") if d in env.found_docs]


def setup(app):
    app.connect("autodoc-process-docstring", _titles_to_rubrics)
    app.connect("env-get-outdated", _always_reread)
    app.add_directive("if-importable", IfImportable)
    app.add_directive("bench-results", BenchResults)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
