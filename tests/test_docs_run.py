"""Every fenced block of README.md and docs/*.md, one test each (named ``file:line``): runnable
blocks run (tests/docsrun.py), skipped shell blocks and usage synopses have their ``sparkv``
commands parsed by the CLI, and every page keeps the convention of docs/docs-tests.md.

The setup the pages may rely on (docs/docs-tests.md): each block runs in its own scratch
directory holding ``document.txt`` (the start of the bundled sample text) and ``server.yaml``
(tenant ``alice``, whose key is ``$SPARKV_API_KEY``), with ``sparkv`` and ``python`` on the
``PATH``. A block marked ``setup=server`` also gets a real ``sparkv serve`` on loopback (one per
module, the bundled SmolLM2, that config), written ``http://127.0.0.1:8080`` in the page, with
``document.txt`` already encoded there as ``$CONTEXT_ID`` (levels raw, q8, q6, q5).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from docsrun import (RUNNABLE, SHELL, Block, DocBlockError, DocsEnv, check_commands,
                     check_imports, collect, expected_output, run_block)

ROOT = Path(__file__).resolve().parent.parent
#: pages the runner does not read (none: docs/cli.md is generated from the parsers and holds only
#: text blocks, checked by tests/test_cli.py)
SKIP_PAGES: dict[str, str] = {}
#: characters of the sample text in document.txt (about 330 SmolLM2 tokens: two token chunks)
DOCUMENT_CHARS = 1500
#: levels $CONTEXT_ID is encoded at (raw for the exact restores; q8, q6 above the quality floor)
LEVELS = ["raw", "q8", "q6", "q5"]

PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                               if str(p.relative_to(ROOT)) not in SKIP_PAGES)
BLOCKS = collect(ROOT, PAGES)
CHECKED = [b for b in BLOCKS if b.lang in RUNNABLE or b.marker.usage or b.problems]


@pytest.fixture(scope="module")
def docs_base(tmp_path_factory):
    """The files and environment every block gets: document.txt, server.yaml, the shims."""
    from sparkv.runtime.generate import sample_text
    from sparkv.server.process import write_config

    base = tmp_path_factory.mktemp("docs-base")
    text = sample_text()[:DOCUMENT_CHARS]
    (base / "document.txt").write_text(text[:text.rindex("\n") + 1])
    keys = write_config(base / "server.yaml", ["alice"])
    bin_dir = tmp_path_factory.mktemp("docs-bin")
    (bin_dir / "sparkv").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m sparkv.cli "$@"\n')
    (bin_dir / "sparkv").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "SPARKV_API_KEY": keys["alice"]}
    return base, env


@pytest.fixture(scope="module")
def docs_server(docs_base, tmp_path_factory):
    """``sparkv serve`` on loopback with server.yaml, and document.txt encoded (its context id)."""
    from helpers import api_client, create_context, stop_checked
    from sparkv.server.process import ServerProcess

    base, env = docs_base
    tmp = tmp_path_factory.mktemp("docs-server")
    server = ServerProcess(base / "server.yaml", f"file://{tmp}/store",
                           log_path=tmp / "server.log").start()
    with api_client(server, env["SPARKV_API_KEY"]) as c:
        ctx = create_context(c, text=(base / "document.txt").read_text(), levels=LEVELS)
    yield server, ctx["context_id"]
    stop_checked(server)


@pytest.fixture(scope="module")
def cli_parser():
    from sparkv.cli import build_parser

    return build_parser()


def _env(block: Block, request, tmp_path: Path) -> DocsEnv:
    base, env = request.getfixturevalue("docs_base")
    for name in ("document.txt", "server.yaml"):
        shutil.copy(base / name, tmp_path / name)
    docs = DocsEnv(tmp_path, dict(env))
    if "server" in block.marker.setup:
        server, context_id = request.getfixturevalue("docs_server")
        docs.env["CONTEXT_ID"] = context_id
        docs.substitutions["127.0.0.1:8080"] = f"127.0.0.1:{server.port}"
    return docs


@pytest.mark.parametrize("block", CHECKED, ids=[b.where for b in CHECKED])
def test_doc_block(block: Block, request, tmp_path):
    if block.problems:
        raise DocBlockError(f"{block.where}: " + "; ".join(block.problems))
    if block.marker.usage or (block.marker.skip and block.lang in SHELL):
        check_commands(block, request.getfixturevalue("cli_parser"))
    if block.marker.skip and block.lang == "python":
        check_imports(block)
    if block.marker.skip:
        pytest.skip(f"{block.where}: {block.marker.skip}")
    if block.runnable:
        run_block(block, _env(block, request, tmp_path), expected_output(BLOCKS, block))


def test_the_pages_are_all_read():
    assert {b.path for b in BLOCKS} >= {"README.md", "docs/rest-api.md", "docs/edge.md"}
    assert not set(SKIP_PAGES) & {b.path for b in BLOCKS}

