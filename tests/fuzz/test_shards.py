"""The long run's summary (tests/fuzz/shards.py): each shard's last line, then each failing case with its problem."""

from tests.fuzz.shards import summary

FAILED_SHARD = """..F.
E       AssertionError: Case(form='pt2e', k=1)
E         qfuse differs from eager where Inductor agrees: nan at 0 places instead of 1
E         repro: python -m tests.fuzz.repro "Case(form='pt2e', k=1)"
E       assert not ['qfuse differs']
1 failed, 3 passed in 9.00s
"""


def test_the_summary_names_each_shard_and_each_failing_case():
    text = summary([(3, FAILED_SHARD), (4, "....\n4 passed in 8.00s\n"), (5, "")])
    assert text.splitlines()[:3] == ["shard 3: 1 failed, 3 passed in 9.00s", "shard 4: 4 passed in 8.00s",
                                     "shard 5: no output"]
    assert "seed 3: Case(form='pt2e', k=1)\n  qfuse differs from eager where Inductor agrees: nan at 0 places" in text
    assert 'repro: python -m tests.fuzz.repro "Case(form=\'pt2e\', k=1)"' in text and "assert not" not in text
