"""The built-in answer checkers (`prl.tasks.checkers`): reward and canonical answer for each case, the math table
on both paths (math-verify and the numeric fallback), and answers that majority voting must count as one."""

from __future__ import annotations

import sys
import threading

import pytest

from prl.tasks import checkers

SYMBOLIC = "symbolic"  # a case only math-verify gets right: the fallback gives reward 0.0 (same answer)

MATH = [  # completion, gold, reward, answer[, SYMBOLIC]
    (r"so \boxed{1/2}", "0.5", 1.0, "1/2"),
    (r"\frac12", "0.5", 1.0, "1/2"),
    (r"we get \dfrac{3}{4}", "0.75", 1.0, "3/4"),
    (r"\boxed{\frac{1}{2}}", "1/2", 1.0, "1/2"),
    ("That is 1,000", "1000", 1.0, "1000"),
    (r"x = 1{,}000", r"\boxed{1000}", 1.0, "1000"),
    ("the answer is 42.", "42", 1.0, "42"),
    ("the answer is 41.", "42", 0.0, "41"),
    (r"\boxed{3}", "1/2", 0.0, "3"),
    ("I don't know", "42", 0.0, None),
    ("", "42", 0.0, None),
    ("It drops to -3 degrees", "-3", 1.0, "-3"),
    ("It drops to -3.5 degrees", "-7/2", 1.0, "-7/2"),
    ("It drops to -3 degrees", "3", 0.0, "-3"),
    ("3 apples and 5 more makes 8", "8", 1.0, "8"),
    ("3 apples and 5 more makes 8", "Natalia sold 3+5 = 8 clips.\n#### 8", 1.0, "8"),
    ("3 apples and 5 more makes 7", "#### 8", 0.0, "7"),
    (r"first \boxed{2}, then \boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt{2}}{2}", 1.0, r"\frac{\sqrt{2}}{2}"),
    (r"\boxed{\frac{1}{2}} and later 7", "1/2", 1.0, "1/2"),  # a box wins over any later number
    (r"\boxed{\$18 \text{ dollars}}", "18", 1.0, "18"),
    (r"\boxed{50\%}", "50", 1.0, "50"),
    (r"\boxed{x + 1}", "x+1", 1.0, "x+1"),
    (r"\boxed{\sqrt{2}}", "2^{1/2}", 1.0, r"\sqrt{2}", SYMBOLIC),
    (r"\boxed{1 + x}", r"\boxed{x+1}", 1.0, "1+x", SYMBOLIC),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0, r"\frac{\pi}{2}", SYMBOLIC),
    (r"\boxed{\sqrt{3}}", "2^{1/2}", 0.0, r"\sqrt{3}"),
]


@pytest.fixture(params=["math-verify", "fallback"])
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(checkers, "math_verify_available", lambda: False)
    else:
        assert checkers.math_verify_available()
    return request.param


@pytest.mark.parametrize("case", MATH, ids=[f"{c[0]!r}-vs-{c[1]!r}" for c in MATH])
def test_math(case, path):
    completion, gold, reward, answer, *only = case
    if only and path == "fallback":
        reward = 0.0
    assert checkers.math(completion, {"answer": gold}) == (reward, answer)


def test_majority_voting_answers_are_one_string():
    same = ["0.5", r"\boxed{1/2}", r"\boxed{\frac{1}{2}}", r"\frac12", r"\dfrac{1}{2}", "so 1/2."]
    assert {checkers.math(c, {"answer": "7"})[1] for c in same} == {"1/2"}
    assert {checkers.math(c, {"answer": "7"})[1] for c in ["1,000", r"\boxed{1000}", "1000.0"]} == {"1000"}
    assert {checkers.choice(c, {"answer": "A"})[1] for c in ["b", "(B)", r"\boxed{B}", "Answer: B"]} == {"B"}
    assert {checkers.exact(c, {"answer": "x"})[1] for c in [" Paris. ", "paris", "PARIS."]} == {"paris"}


def test_math_verify_failures_never_leave_the_checker(monkeypatch):
    import math_verify

    def broken(*args, **kwargs):
        raise RuntimeError("parser broke")

    monkeypatch.setattr(math_verify, "parse", broken)
    assert checkers.math(r"\boxed{\sqrt{2}}", {"answer": "2^{1/2}"}) == (0.0, r"\sqrt{2}")
    assert checkers.math(r"\boxed{1/2}", {"answer": "0.5"}) == (1.0, "1/2")  # the numbers still compare


def test_math_off_the_main_thread_uses_the_fallback():
    """math-verify's timeouts need SIGALRM (main thread only): elsewhere the checker falls back, no error."""
    out = []
    cases = [(r"\boxed{\sqrt{2}}", "2^{1/2}"), (r"\boxed{1/2}", "0.5")]
    t = threading.Thread(target=lambda: out.extend(checkers.math(c, {"answer": g}) for c, g in cases))
    t.start()
    t.join()
    assert out == [(0.0, r"\sqrt{2}"), (1.0, "1/2")]


def test_math_verify_available_when_absent(monkeypatch):
    checkers.math_verify_available.cache_clear()
    monkeypatch.setitem(sys.modules, "math_verify", None)  # an import of it now fails
    try:
        assert checkers.math_verify_available() is False
    finally:
        checkers.math_verify_available.cache_clear()


CHOICE = [  # completion, gold, reward, answer
    ("The answer is (B).", "B", 1.0, "B"),
    ("b", "(B)", 1.0, "B"),
    ("C", "B", 0.0, "C"),
    ("Answer: D", "d", 1.0, "D"),
    ("The correct answer is: **A**", "A", 1.0, "A"),
    (r"so \boxed{C}", "C", 1.0, "C"),
    (r"so \boxed{\text{(E)}}", "E", 1.0, "E"),
    ("Options (A) and (C) fail, so (D)", "D", 1.0, "D"),  # the last match wins
    ("Answer: A. On reflection, the answer is B", "B", 1.0, "B"),
    ("The answer is (B) because (C) is wrong", "B", 1.0, "B"),  # an "answer is" outranks a bare "(C)"
    ("the answer is a tricky one; I pick J", "J", 1.0, "J"),  # a lower-case word "a" is no choice
    ("I have no idea", "B", 0.0, None),
    ("", "B", 0.0, None),
]


@pytest.mark.parametrize("completion,gold,reward,answer", CHOICE)
def test_choice(completion, gold, reward, answer):
    assert checkers.choice(completion, {"answer": gold}) == (reward, answer)


EXACT = [  # completion, gold, reward, answer
    (" Paris. ", "paris", 1.0, "paris"),
    ("New   York\n", "new york.", 1.0, "new york"),
    ("London", "Paris", 0.0, "london"),
    ("Paris, France", "Paris", 0.0, "paris, france"),
    (" ... ", "Paris", 0.0, None),
    ("", "", 0.0, None),
]


@pytest.mark.parametrize("completion,gold,reward,answer", EXACT)
def test_exact(completion, gold, reward, answer):
    assert checkers.exact(completion, {"answer": gold}) == (reward, answer)


def test_registry_and_gold_types():
    assert checkers.CHECKERS == {"exact": checkers.exact, "math": checkers.math, "choice": checkers.choice}
    assert checkers.math("12", {"answer": 12}) == (1.0, "12")  # a gold that is not a string
    assert checkers.exact("3", {"answer": 3}) == (1.0, "3")


def test_choice_does_not_read_the_words_i_and_a_as_letters():
    choice = checkers.choice
    assert choice("Answer: I think the correct option is (B)", {"answer": "B"}) == (1.0, "B")
    assert choice("Answer: A good guess is (D)", {"answer": "D"}) == (1.0, "D")
    assert choice("Answer: I", {"answer": "I"}) == (1.0, "I")
    assert choice("The answer is B because it fits", {"answer": "B"}) == (1.0, "B")
