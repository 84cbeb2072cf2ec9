"""The README's claims and what proves each (docs/correctness.md, the last table) stay true together:

- every claim quoted in the table still stands in README.md, word for word (spaces aside);
- every test the table names exists (its file defines it); a row with no test says "benchmark only"
  or "GPU check only" and names a file that exists; no row is without a proof;
- every README sentence that makes a checkable claim (CLAIM_WORDS) holds one of the quotes, so a
  claim added to the README without a row here fails this test.
"""
from __future__ import annotations

import re

import pytest

from testing.local import REPO

TABLE_TITLE = "## The README's claims and what proves each"
# The words of a checkable claim: a sentence of the README that holds one must be in the table.
CLAIM_WORDS = re.compile(r"\b(proven|proves|tested|bit-identical|bit for bit|bit-exact|matches|match|refused|"
                         r"within|measured|exit \d|exits \d)\b", re.I)
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
FILE_REF = re.compile(r"`([\w./-]+\.(?:py|sh|md)|\.ci/run)`")


def flat(text: str) -> str:
    return " ".join(text.split())


def claims_table() -> list[tuple[str, str]]:
    """(quoted README text, proof cell) for each row of the table."""
    text = (REPO / "docs" / "correctness.md").read_text()
    assert TABLE_TITLE in text, f"docs/correctness.md lacks the section {TABLE_TITLE!r}"
    rows = []
    for line in text.split(TABLE_TITLE, 1)[1].splitlines():
        m = re.fullmatch(r'\| "(.+)" \| (.+) \|', line.strip())
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def readme_sentences() -> list[str]:
    """The README's prose and table rows, code blocks and figures left out, cut into sentences."""
    text = re.sub(r"```.*?```", "", (REPO / "README.md").read_text(), flags=re.S)
    out = []
    for block in re.split(r"\n\s*\n", text):
        for part in block.splitlines() if block.lstrip().startswith("|") else [block]:
            if not part.lstrip().startswith("!["):
                out += [flat(s) for s in re.split(r"(?<=[.;])\s+(?=[A-Z`*(])", flat(part)) if s.strip()]
    return out


ROWS = claims_table()


def test_the_table_has_rows_and_each_quote_is_once():
    quotes = [q for q, _ in ROWS]
    assert len(quotes) >= 40 and len(set(quotes)) == len(quotes)


@pytest.mark.parametrize("quote, proof", ROWS, ids=[q[:40] for q, _ in ROWS])
def test_each_quote_stands_in_the_readme_and_its_proof_exists(quote, proof):
    assert flat(quote) in flat((REPO / "README.md").read_text()), f"the README no longer says: {quote}"
    assert "NONE" not in proof.upper().split(), proof
    tests = TEST_REF.findall(proof)
    for path, name in tests:
        assert (REPO / path).is_file(), f"{path} does not exist"
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path} defines no {name}"
    if not tests:
        assert proof.startswith(("benchmark only: ", "GPU check only: ")), f"no test and no other proof: {proof}"
    for path in FILE_REF.findall(proof):
        assert (REPO / path).exists(), f"{path} does not exist"


def test_every_sentence_of_the_readme_that_makes_a_claim_holds_a_quote():
    quotes = [flat(q) for q, _ in ROWS]
    missing = [s for s in readme_sentences() if CLAIM_WORDS.search(s) and not any(q in s for q in quotes)]
    assert not missing, ("README sentences that make a claim with no row in docs/correctness.md's table:\n"
                         + "\n".join(f"- {s[:200]}" for s in missing))
