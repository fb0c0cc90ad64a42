"""The docs runner (tests/docsrun.py) itself: it finds every fenced block with its file and line,
reads the markers, and fails on a broken block, naming ``file:line``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from docsrun import (DocBlockError, DocsEnv, check_commands, check_imports, collect,
                     output_matches, parse_marker, run_block, split_console)

PAGE = """\
# A page

```python
print(1 + 1)
```

<!-- docs-test: output -->
```text
2
```

```python
import json
json.loads("{broken")
```

```bash
echo fine
false
echo never printed
```

<!-- docs-test: skip (needs a GPU) -->
```bash
sparkv bench prefill --json --no-such-flag
```

<!-- docs-test: usage -->
```text
sparkv ask --server URL --context ID "question" [--mbps N]
           [--not-a-flag]    # a comment: [--ignored]
```

```
an untagged fence
```
"""


@pytest.fixture
def page(tmp_path: Path):
    (tmp_path / "page.md").write_text(PAGE)
    return collect(tmp_path, ["page.md"])


@pytest.fixture
def env(tmp_path: Path) -> DocsEnv:
    (tmp_path / "run").mkdir()
    return DocsEnv(tmp_path / "run")


def test_blocks_are_found_with_their_file_line_language_and_marker(page):
    assert [(b.where, b.lang) for b in page] == [
        ("page.md:3", "python"), ("page.md:8", "text"), ("page.md:12", "python"),
        ("page.md:17", "bash"), ("page.md:24", "bash"), ("page.md:29", "text"),
        ("page.md:34", "")]
    assert page[1].marker.output and page[4].marker.skip == "needs a GPU"
    assert page[5].marker.usage and not page[4].runnable and page[2].runnable
    assert page[6].problems and "must name its language" in page[6].problems[0]


def test_a_good_block_runs_and_its_output_is_checked(page, env):
    assert run_block(page[0], env, expected=page[1].text) == "2\n"
    with pytest.raises(DocBlockError, match=r"page.md:3: the output differs"):
        run_block(page[0], env, expected="3\n")


def test_a_broken_python_block_fails_naming_its_file_and_line(page, env):
    with pytest.raises(DocBlockError, match=r"^page.md:12: the python block raised "
                                            r"JSONDecodeError") as err:
        run_block(page[2], env)
    # the traceback points into the page: json.loads is on line 14 of page.md
    tb = err.value.__cause__.__traceback__
    while tb.tb_next and tb.tb_frame.f_code.co_filename != "page.md":
        tb = tb.tb_next
    assert (tb.tb_frame.f_code.co_filename, tb.tb_lineno) == ("page.md", 14)


def test_a_broken_bash_block_fails_naming_its_file_and_line(page, env):
    with pytest.raises(DocBlockError, match=r"^page.md:17: the bash block exited with 1") as err:
        run_block(page[3], env)
    assert "fine" in str(err.value) and "never printed" not in str(err.value)


def test_a_block_that_does_not_return_is_stopped(tmp_path, env):
    (tmp_path / "p.md").write_text("<!-- docs-test: timeout=1 -->\n```sh\nsleep 30 & wait\n```\n")
    (block,) = collect(tmp_path, ["p.md"])
    with pytest.raises(DocBlockError, match=r"p.md:2: still running after 1 s"):
        run_block(block, env)


def test_placeholders_and_the_environment_reach_the_block(tmp_path, env):
    (tmp_path / "p.md").write_text(
        "```bash\necho http://127.0.0.1:8080 $CONTEXT_ID\n```\n"
        "```python\nimport os\nprint('http://127.0.0.1:8080', os.environ['CONTEXT_ID'])\n```\n")
    env.env["CONTEXT_ID"] = "abc"
    env.substitutions["127.0.0.1:8080"] = "127.0.0.1:9"
    for block in collect(tmp_path, ["p.md"]):
        assert run_block(block, env) == "http://127.0.0.1:9 abc\n"


def test_skipped_commands_and_usage_lines_are_checked_against_the_cli(page):
    from sparkv.cli import build_parser

    parser = build_parser()
    with pytest.raises(DocBlockError, match=r"page.md:24: `sparkv bench prefill .*"
                                            r"unrecognized arguments: --no-such-flag"):
        check_commands(page[4], parser)
    with pytest.raises(DocBlockError, match=r"page.md:29: .*sparkv ask has no --not-a-flag$"):
        check_commands(page[5], parser)


def test_skipped_python_blocks_still_import_what_they_name(tmp_path):
    (tmp_path / "p.md").write_text(textwrap.dedent("""\
        <!-- docs-test: skip (needs root) -->
        ```python
        from sparkv.codec import encode
        from sparkv.codec import no_such_name
        do_something_that_needs_root()
        ```
        """))
    (block,) = collect(tmp_path, ["p.md"])
    with pytest.raises(DocBlockError, match=r"p.md:2: ImportError: cannot import name "
                                            r"'no_such_name'"):
        check_imports(block)


def test_markers_and_outputs_follow_the_rules(tmp_path):
    assert parse_marker("skip (needs Docker)")[0].skip == "needs Docker"
    assert parse_marker("setup=server timeout=60")[0].setup == ("server",)
    assert parse_marker("skip")[1] and parse_marker("setup=gpu")[1]
    (tmp_path / "p.md").write_text("<!-- docs-test: output -->\n```text\n1\n```\n")
    (block,) = collect(tmp_path, ["p.md"])
    assert block.problems == ("an 'output' block must follow a block that runs",)


def test_output_matching():
    assert output_matches("key: skv_...\nend\n", "key: skv_abc  \nend")
    assert output_matches("a\n...\nz", "a\nb\nc\nz\n")
    assert not output_matches("a\nz", "a\nb\nz")
    assert split_console("$ echo a \\\n  b\na b\n") == ("echo a \\\n  b\n", "a b\n")
