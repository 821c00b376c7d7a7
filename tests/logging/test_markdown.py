"""token_weights.md's text: one `piece(weight)` per token, the pieces of a word together and
words apart, whitespace tokens shown escaped."""

from __future__ import annotations

from jaxvrl.logging.markdown import token_weight_section


def test_a_words_pieces_are_written_together_and_words_apart():
    pieces = [("The", 1.0), (" yellow", 1.1), ("ish", 0.9), (" cube", 1.0), ("\n", 0.5),
              ("你", 1.0), ("好", 2.0), (".", 1.0)]  # fmt: skip
    text = token_weight_section(3, [pieces], None)
    assert "The(1.00) yellow(1.10)ish(0.90) cube(1.00) \\n(0.50) 你(1.00)好(2.00).(1.00)" in text
    assert text.startswith("## Step 3")
