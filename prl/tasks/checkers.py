"""Built-in answer checkers for dataset-file tasks: `CHECKERS[name](completion, example) -> (reward, answer)`.

Each compares the completion with `str(example["answer"])` and gives reward 1.0 or 0.0, and the answer it read
from the completion in a canonical form (None when it found none, reward 0.0): majority voting (maj@k) counts
answers by string equality, so the same answer written two ways gives one string where that is cheap.

- `exact`: the whole completion against the gold, both stripped, casefolded, whitespace collapsed and trailing
  periods dropped; the answer is the normalised completion.
- `math`: the final answer is the content of the last `\\boxed{...}` (nested braces fine), else the last number
  in the text (integer, decimal, negative, thousands separators as in 1,000, a/b). The gold may be a plain
  number or expression, `\\boxed{...}` or GSM8K's "... #### 42". Answers equal as exact fractions
  (`0.5`, `1/2`, `\\frac{1}{2}`, `\\frac12`, `\\dfrac{1}{2}`, `1,000`, `50%` read as 50) score 1.0 at once;
  otherwise the math-verify package (`pip install 'prl[data]'`), when installed, compares them symbolically
  (`\\sqrt{2}` = `2^{1/2}`, `x+1` = `1+x`). Without it, or off the main thread (math-verify's timeouts use
  SIGALRM, which only the main thread may set), non-numeric answers must match as normalised strings.
  The canonical answer is the fraction ("1/2", "1000", "-3") when the answer is a number, else the
  normalised LaTeX.
- `choice`: the letter (A-J) a multiple-choice completion picks: the last "answer is (B)" / "Answer: B" /
  `\\boxed{C}`, else the last "(D)" or a lone letter closing the completion. The answer is the upper-case letter;
  the gold may be "B", "(B)" or "b".
"""

from __future__ import annotations

import functools
import re
import threading
from fractions import Fraction
from typing import Callable

NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\\[dt]?frac(?:\{[^{}]*\}|\d){2}"
                    r"|(?<![\w.])(?:\d{1,3}(?:(?:,|\{,\})\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?!\d))")
FRAC = re.compile(r"^\\frac(\{[^{}]*\}|\d)(\{[^{}]*\}|\d)$")
UNITS = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}|\^\{?\\circ\}?")  # dropped when reading a number
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
STRONG_CHOICE = re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*\(?([A-Ja-j])\)?\s*\}?\s*\}"
                           r"|(?i:answer)(?:\s+is)?\s*[:=]?\s*\**\s*(?:\(([A-Ja-j])\)|([B-HJ])(?!\w)"
                           r"|([AI])(?=\s*(?:[.,;:!*)\]]|$)))")  # "Answer: I think..." names no choice
WEAK_CHOICE = re.compile(r"\(([A-J])\)|(?:^|\s)\(?([A-J])\)?[.:]?\s*$|^\s*\(?([A-Ja-j])\)?[.]?\s*$")


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold().rstrip(".").strip()


def exact(completion: str, example: dict) -> tuple[float, str | None]:
    answer = _normalise(completion)
    if not answer:
        return 0.0, None
    return float(answer == _normalise(str(example["answer"]))), answer


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` whose braces close, or None."""
    found = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth = 1
        for i in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found = text[m.end():i]
                break
    return found


def _final_answer(text: str) -> str | None:
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip() or None
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _gold(text: str) -> str:
    if "####" in text:
        return text.rpartition("####")[2].strip()
    boxed = _last_boxed(text)
    return (boxed if boxed is not None else text).strip()


def _clean(text: str) -> str:
    """LaTeX normalised for string comparison: no spaces, `$`, `\\left`/`\\right`, spacing commands, `\\dfrac`."""
    text = re.sub(r"\\[,;:!]|\\left|\\right|\\?\$|\s+", "", text.replace("{,}", ","))
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    return text.rstrip(".")


def _number(text: str) -> Fraction | None:
    """`text` as an exact fraction: 42, -3, 0.5, 1,000, 1/2, \\frac{1}{2}, \\frac12, 50% (as 50); else None."""
    text = THOUSANDS.sub("", UNITS.sub("", _clean(text))).removesuffix("\\%").removesuffix("%")
    sign = -1 if text.startswith("-") else 1
    m = FRAC.match(text.removeprefix("-"))
    try:
        if m:
            return sign * Fraction(m[1].strip("{}")) / Fraction(m[2].strip("{}"))
        if "/" in text:
            num, _, den = text.partition("/")
            return Fraction(num) / Fraction(den)
        return Fraction(text) if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", text) else None
    except (ValueError, ZeroDivisionError):
        return None


def _canonical(text: str) -> str:
    value = _number(text)
    return str(value) if value is not None else _clean(text)


@functools.lru_cache(maxsize=1)
def math_verify_available() -> bool:
    """Whether the optional math-verify package imports (`pip install 'prl[data]'`)."""
    try:
        import math_verify  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or broken by its own dependencies: either way, not usable
        return False
    return True


def _symbolic(gold: str, answer: str) -> bool | None:
    """math-verify's verdict on `answer` against `gold`; None when it cannot give one here."""
    if not math_verify_available() or threading.current_thread() is not threading.main_thread():
        return None
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        g, a = parse(f"${gold.strip('$')}$"), parse(f"${answer.strip('$')}$")
        return bool(g and a and verify(g, a))
    except (Exception, TimeoutException):  # noqa: BLE001 - a checker never raises; the timeout is a BaseException
        return None


def math(completion: str, example: dict) -> tuple[float, str | None]:
    found = _final_answer(completion)
    if found is None:
        return 0.0, None
    gold = _gold(str(example["answer"]))
    answer = _canonical(found)
    if answer == _canonical(gold):
        return 1.0, answer
    return float(bool(_symbolic(gold, found))), answer


def _letter(text: str) -> str | None:
    for pattern in (STRONG_CHOICE, WEAK_CHOICE):
        matches = list(pattern.finditer(text))
        if matches:
            return next(g for g in matches[-1].groups() if g).upper()
    return None


def choice(completion: str, example: dict) -> tuple[float, str | None]:
    answer = _letter(completion)
    if answer is None:
        return 0.0, None
    gold = str(example["answer"])
    return float(answer == (_letter(gold) or gold.strip().upper())), answer


CHECKERS: dict[str, Callable[[str, dict], tuple[float, str | None]]] = {"exact": exact, "math": math, "choice": choice}
