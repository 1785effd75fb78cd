"""The README's reading order says what the files are: their line counts, none above 300."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def reading_order():
    """The README's reading order: -> (its text, [(file, its line count, what to look for)])"""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Reading order"):text.index("## Files")]
    return section, re.findall(r"^\| \d+ \| `([\w/]+\.py)` \| (\d+) \| (.*) \|$", section, re.M)


def test_the_reading_order_counts_the_files_as_they_are():
    section, rows = reading_order()
    assert len(rows) >= 6
    counts = {name: len((REPO / name).read_text().splitlines()) for name, _, _ in rows}
    assert {name: int(n) for name, n, _ in rows} == counts
    assert max(counts.values()) <= 300
    total = int(re.search(r"\(([\d,]+) lines, counted whole\)", section).group(1).replace(",", ""))
    assert total == sum(counts.values())
