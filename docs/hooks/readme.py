"""MkDocs hook: the README is the site's home page (its links into docs/ made site-relative), and the pages' links
to the README go to that home page. The README stays the one copy of its text."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]


def on_files(files: Files, config) -> Files:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    text = re.sub(r"\]\(docs/", "](", text)
    files.append(File.generated(config, "index.md", content=text))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace("](../README.md", "](index.md")
