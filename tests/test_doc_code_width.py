"""No line of a code block in README.md or docs/**/*.md is wider than 88 characters.

Wider lines scroll sideways on the site and in a diff, and wrap in a terminal.
Every fenced block counts, whatever its language: programs, ``diff`` blocks,
``{eval-rst}`` directives and program output (``text``: a long message is shown
wrapped, and the prose around it says so). The blocks are read as
``tests/test_doc_blocks.py`` reads them to run them: a block inside a list item
is dedented as a whole, so its width is the one the reader sees.
"""
from test_doc_blocks import ALL_BLOCKS, Block, _id

MAX_WIDTH = 88


def too_wide(blocks, width=MAX_WIDTH):
    """``"<file>:L<fence>-<language> line <n>: <width> characters"`` for each line of ``blocks`` over ``width``."""
    return ["%s line %d: %d characters" % (_id(block), block.line + 1 + index, len(line))
            for block in blocks for index, line in enumerate(block.code.splitlines()) if len(line) > width]


def test_no_code_line_in_the_docs_is_wider_than_88_characters():
    assert len(ALL_BLOCKS) > 50 and any(block.path == "README.md" for block in ALL_BLOCKS)
    wide = too_wide(ALL_BLOCKS)
    assert not wide, "wrap these lines (at most %d characters): %s" % (MAX_WIDTH, wide)


def test_a_line_one_character_too_wide_is_named_by_file_and_line():
    block = Block("text", 10, "", "", "short\n" + "x" * 89 + "\n", "docs/guides/page.md")
    assert too_wide([block]) == ["docs/guides/page.md:L10-text line 12: 89 characters"]
    assert too_wide([block._replace(code="x" * 88 + "\n", language="python")]) == []
